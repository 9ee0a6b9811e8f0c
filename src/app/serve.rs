//! `serve`: builds the pipeline and the serve configuration from the settings, starts the
//! metrics endpoint if asked, and runs the service until a signal or a failed task.

use embed_dlq::config::{FileConfig, IngestSettings, Settings};
use embed_dlq::serve::ServeConfig;
use embed_dlq::streams::RedisClient;
use tokio_util::sync::CancellationToken;

use super::args::ServeCommand;
use super::{Resolver, exit};

/// Runs `serve`; returns the exit code.
pub async fn command(resolver: &Resolver, args: ServeCommand, cancel: CancellationToken) -> i32 {
    let ServeCommand { provider, ingest, retry, serve } = args;
    let flags =
        FileConfig { provider: *provider, ingest: *ingest, retry: *retry, serve, ..Default::default() };
    let resolved = resolver.settings(flags).and_then(|s| Ok((s.ingest()?, s.redis_client()?, s)));
    match resolved {
        Ok((ingest, redis, settings)) => run(&settings, ingest, redis, cancel).await,
        Err(e) => exit::usage(&e),
    }
}

/// Builds the pipeline and runs the service.
async fn run(
    settings: &Settings,
    ingest: IngestSettings,
    redis: RedisClient,
    cancel: CancellationToken,
) -> i32 {
    let config = ServeConfig::from_settings(settings);
    let pipeline = match config.pipeline_settings(ingest).pipeline().await {
        Ok(p) => p,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    if let Some(addr) = settings.serve.metrics_addr
        && let Err(e) = embed_dlq::metrics::install(addr)
    {
        return exit::fail(exit::FAILURE, &e.to_string());
    }
    match embed_dlq::serve::serve(pipeline.store, pipeline.embedder, redis, config, cancel).await {
        Ok(()) => exit::OK,
        // The configuration does not fit the streams: a usage error, nothing ran.
        Err(e @ embed_dlq::serve::ServeError::Shards(_)) => exit::fail(exit::USAGE, &e.to_string()),
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}
