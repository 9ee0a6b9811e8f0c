//! `revision`: lists a target's revisions, makes a shadow one, backfills it (an ingest into
//! every live revision), switches the target's name to it (or back) and retires one,
//! rendering the outcome and mapping a refusal to exit 2.

use embed_dlq::config::{FileConfig, IngestArgs};
use embed_dlq::store::revision::{self, Revision, RevisionError};
use tokio_util::sync::CancellationToken;

use super::args::{RevisionAction, RevisionCommand};
use super::{Resolver, exit};

/// Runs `revision`; returns the exit code.
pub async fn command(resolver: &Resolver, args: RevisionCommand, cancel: CancellationToken) -> i32 {
    let RevisionCommand { action, json } = args;
    let target = match action {
        RevisionAction::Backfill(ingest) => return backfill(resolver, *ingest, json, cancel).await,
        RevisionAction::List { ref target }
        | RevisionAction::Create { ref target, .. }
        | RevisionAction::Activate { ref target, .. }
        | RevisionAction::Retire { ref target, .. } => target.clone(),
    };
    let listing_all = matches!(action, RevisionAction::List { target: None });
    let flags =
        FileConfig { ingest: IngestArgs { table: target, ..Default::default() }, ..Default::default() };
    let (settings, pool) = match database(resolver, flags).await {
        Ok(r) => r,
        Err(code) => return code,
    };
    let table = settings.table.as_str();
    match action {
        RevisionAction::List { .. } => {
            match listed_with_coverage(&pool, (!listing_all).then_some(table)).await {
                Ok(all) => print_revisions(&all, json),
                Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
            }
            exit::OK
        }
        RevisionAction::Create { model, dimensions, request_dimensions, active_model, .. } => {
            let made = revision::create_shadow(
                &pool,
                table,
                active_model.as_deref(),
                &model,
                dimensions as usize,
                request_dimensions.map(|d| d as usize),
            )
            .await;
            match made {
                Ok(r) => {
                    if json {
                        println!("{}", revision_json(&r));
                    } else {
                        println!(
                            "revision {} of {} made: {} (vector({}), model {}), a shadow: every ingest of {} (corpus and stream source) writes it from now on; fill it with `embed-dlq revision backfill CORPUS --table {}`",
                            r.revision, r.target, r.relation, r.dimensions, model, r.target, r.target
                        );
                    }
                    exit::OK
                }
                Err(e @ embed_dlq::store::StoreError::Target { .. }) => {
                    exit::fail(exit::USAGE, &e.to_string())
                }
                Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
            }
        }
        RevisionAction::Activate { revision, previous, allow_missing, wait_secs, .. } => {
            let wanted = if previous { None } else { revision };
            let wait = std::time::Duration::from_secs(wait_secs);
            match revision::activate_quiesced(&pool, table, wanted, allow_missing, wait).await {
                Ok(a) => {
                    if json {
                        println!("{}", serde_json::to_string(&a).expect("serializes"));
                    } else {
                        println!(
                            "{} now answers revision {} (revision {} kept as previous, still written, for a rollback: `embed-dlq revision activate --previous`); {} of {} chunks covered (checked in {} ms; queries of the name waited at most {:.1} ms for the switch)",
                            a.target,
                            a.active,
                            a.previous,
                            a.coverage.covered,
                            a.coverage.active_chunks,
                            a.coverage_check_ms,
                            a.switch_us as f64 / 1000.0
                        );
                    }
                    exit::OK
                }
                Err(e @ (RevisionError::NotCovered { .. } | RevisionError::NotSwitchable { .. })) => {
                    if let (true, RevisionError::NotCovered { coverage, .. }) = (json, &e) {
                        println!("{}", serde_json::to_string(coverage).expect("serializes"));
                    }
                    exit::fail(exit::USAGE, &e.to_string())
                }
                Err(RevisionError::Store(e @ embed_dlq::store::StoreError::Target { .. })) => {
                    exit::fail(exit::USAGE, &e.to_string())
                }
                Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
            }
        }
        RevisionAction::Retire { revision, yes, .. } => {
            if !yes {
                return exit::fail(
                    exit::USAGE,
                    &format!(
                        "retiring drops revision {revision}'s table and its manifest and DLQ rows for good: add --yes"
                    ),
                );
            }
            match revision::retire(&pool, table, revision).await {
                Ok(r) => {
                    if json {
                        println!("{}", serde_json::to_string(&r).expect("serializes"));
                    } else {
                        println!(
                            "revision {} of {} retired: {} dropped, {} manifest and {} DLQ rows deleted",
                            r.revision, r.target, r.relation, r.manifest_rows, r.dlq_rows
                        );
                    }
                    exit::OK
                }
                Err(e @ RevisionError::NotSwitchable { .. }) => exit::fail(exit::USAGE, &e.to_string()),
                Err(RevisionError::Store(e @ embed_dlq::store::StoreError::Target { .. })) => {
                    exit::fail(exit::USAGE, &e.to_string())
                }
                Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
            }
        }
        RevisionAction::Backfill(_) => unreachable!("handled above"),
    }
}

/// `revision backfill`: the corpus copied into every live revision but the active one, each
/// line only where the active revision holds that very text ([`embed_dlq::ingest::CopyOf`]);
/// refused (exit 2) when the target has no revision besides the active one.
async fn backfill(
    resolver: &Resolver,
    mut ingest: super::args::IngestCommand,
    json: bool,
    cancel: CancellationToken,
) -> i32 {
    if !ingest.source.streams.is_empty() {
        return exit::fail(exit::USAGE, "revision backfill reads a corpus, not --from-stream");
    }
    ingest.json |= json;
    let flags = FileConfig { ingest: (*ingest.ingest).clone(), ..Default::default() };
    let (settings, pool) = match database(resolver, flags).await {
        Ok(r) => r,
        Err(code) => return code,
    };
    let mut table = settings.table.clone();
    if let Some(name) = &ingest.from_table {
        let source = match embed_dlq::store::table_source::load(&pool, name).await {
            Ok(s) => s,
            Err(e) => return exit::fail(exit::USAGE, &e.to_string()),
        };
        if ingest.ingest.table.as_ref().is_some_and(|t| *t != source.target_table) {
            return exit::fail(
                exit::USAGE,
                &format!("table source {name} writes {}, not --table {table}", source.target_table),
            );
        }
        table = source.target_table;
    }
    match revision::live(&pool, &table).await {
        Ok(live) if live.len() > 1 => {}
        Ok(_) => {
            return exit::fail(
                exit::USAGE,
                &format!(
                    "{table} has no revision to backfill: make one with `embed-dlq revision create --table {table} --model M --dimensions N`"
                ),
            );
        }
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    }
    pool.close().await;
    super::ingest::command_as(resolver, ingest, super::ingest::Run::Backfill, cancel).await
}

/// The settings `flags` resolve to and a small pool on their database, migrated; `Err`
/// holds the exit code (reported).
async fn database(
    resolver: &Resolver,
    flags: FileConfig,
) -> Result<(embed_dlq::config::Settings, sqlx::PgPool), i32> {
    let (settings, url) = resolver.with_database(flags).map_err(|e| exit::usage(&e))?;
    let pool =
        embed_dlq::store::connect(&url, 2).await.map_err(|e| exit::fail(exit::FAILURE, &e.to_string()))?;
    embed_dlq::store::migrate(&pool).await.map_err(|e| exit::fail(exit::FAILURE, &e.to_string()))?;
    Ok((settings, pool))
}

fn revision_json(r: &Revision) -> serde_json::Value {
    serde_json::json!({
        "target": r.target, "revision": r.revision, "state": r.state, "identity": r.identity,
        "relation": r.relation, "model": r.model, "dimensions": r.dimensions,
        "request_dimensions": r.request_dimensions,
    })
}

/// The revisions `target` (or every target) has, each shadow and previous one with how far it
/// covers its target's active revision (what `activate` would find now).
async fn listed_with_coverage(
    pool: &sqlx::PgPool,
    target: Option<&str>,
) -> Result<Vec<(Revision, Option<revision::Coverage>)>, embed_dlq::store::StoreError> {
    let all = revision::list(pool, target).await?;
    let mut conn = pool.acquire().await?;
    let mut out = Vec::with_capacity(all.len());
    for r in &all {
        let active = all.iter().find(|a| a.target == r.target && a.state == "active");
        let coverage = match active {
            Some(a) if r.state == "shadow" || r.state == "previous" => {
                Some(revision::coverage(&mut conn, a, r).await?)
            }
            _ => None,
        };
        out.push((r.clone(), coverage));
    }
    Ok(out)
}

fn print_revisions(all: &[(Revision, Option<revision::Coverage>)], json: bool) {
    if json {
        let rows: Vec<_> = all
            .iter()
            .map(|(r, c)| {
                let mut v = revision_json(r);
                v["coverage"] = serde_json::to_value(c).expect("serializes");
                v
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return;
    }
    if all.is_empty() {
        println!("no revisions (a target gets them with `embed-dlq revision create`)");
        return;
    }
    println!(
        "{:<32} {:>4}  {:<8}  {:>6}  {:<24}  {:<22}  relation",
        "target", "rev", "state", "dims", "model", "covers the active one"
    );
    for (r, c) in all {
        let covered = match c {
            Some(c) if c.active_chunks > 0 => {
                format!(
                    "{}/{} ({:.1}%)",
                    c.covered,
                    c.active_chunks,
                    100.0 * c.covered as f64 / c.active_chunks as f64
                )
            }
            Some(c) => format!("{}/0", c.covered),
            None => "-".into(),
        };
        println!(
            "{:<32} {:>4}  {:<8}  {:>6}  {:<24}  {:<22}  {}",
            r.target,
            r.revision,
            r.state,
            r.dimensions,
            r.model.as_deref().unwrap_or("(as configured)"),
            covered,
            r.relation
        );
    }
}
