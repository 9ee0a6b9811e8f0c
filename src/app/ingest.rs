//! `ingest`: opens the input, runs the pipeline, prints the summary and maps it to an exit
//! code.

use embed_dlq::config::{FileConfig, IngestSettings};
use embed_dlq::ingest::IngestError;
use tokio_util::sync::CancellationToken;

use super::args::IngestCommand;
use super::render::print_summary;
use super::{Resolver, exit};

/// Runs `ingest`; returns the exit code.
pub async fn command(resolver: &Resolver, args: IngestCommand, cancel: CancellationToken) -> i32 {
    let IngestCommand { input, provider, ingest, retry, json, no_progress, metrics_addr, yes, dry_run } =
        args;
    let flags = FileConfig { provider: *provider, ingest: *ingest, retry: *retry, ..Default::default() };
    let settings = match resolver.settings(flags) {
        Ok(s) => {
            super::warn_missing_api_key(&s);
            s
        }
        Err(e) => return exit::usage(&e),
    };
    let mut settings = match settings.ingest() {
        Ok(s) => s,
        Err(e) => return exit::usage(&e),
    };
    settings.options.cleanup.confirmed = yes;
    settings.options.cleanup.dry_run = dry_run;
    if let Some(addr) = metrics_addr
        && let Err(e) = embed_dlq::metrics::install(addr)
    {
        return exit::fail(exit::FAILURE, &e.to_string());
    }
    run(settings, &input, json, !no_progress, cancel).await
}

/// Ingests `input` (a path, or `-` for stdin).
async fn run(
    mut settings: IngestSettings,
    input: &str,
    json: bool,
    progress: bool,
    cancel: CancellationToken,
) -> i32 {
    use std::io::IsTerminal;
    settings.options.progress = progress && !json && std::io::stderr().is_terminal();
    let dry_run = settings.options.cleanup.dry_run;
    let reader: Box<dyn tokio::io::AsyncBufRead + Unpin + Send> = if input == "-" {
        Box::new(tokio::io::BufReader::with_capacity(256 * 1024, tokio::io::stdin()))
    } else {
        match tokio::fs::File::open(input).await {
            Ok(f) => {
                settings.options.total_bytes = f.metadata().await.ok().map(|m| m.len());
                Box::new(tokio::io::BufReader::with_capacity(256 * 1024, f))
            }
            Err(e) => return exit::fail(exit::FAILURE, &format!("cannot open {input}: {e}")),
        }
    };
    let pipeline = match settings.pipeline().await {
        Ok(p) => p,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    match pipeline.run(reader, cancel.clone()).await {
        Ok(summary) if dry_run => {
            print_summary(&summary, json);
            if cancel.is_cancelled() { exit::INTERRUPTED } else { exit::OK }
        }
        Ok(summary) => {
            print_summary(&summary, json);
            exit::summary_exit_code(&summary, cancel.is_cancelled())
        }
        Err(IngestError::CleanupRefused { reason, summary }) => {
            print_summary(&summary, json);
            exit::fail(exit::USAGE, &reason)
        }
        Err(IngestError::Provider { stop, summary }) => {
            print_summary(&summary, json);
            exit::fail(
                exit::PROVIDER_STOP,
                &format!("{stop}. Nothing was parked for this; fix it and rerun the same corpus."),
            )
        }
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}
