//! `serve`: builds the pipeline and the serve configuration from the settings (with the
//! console's, for `--console-addr`), starts the metrics endpoint if asked, and runs the
//! service until a signal or a failed task.

use embed_dlq::config::{FileConfig, IngestSettings, Settings};
use embed_dlq::console::{ConsoleConfig, MountedConsole};
use embed_dlq::serve::ServeConfig;
use embed_dlq::streams::RedisClient;
use tokio_util::sync::CancellationToken;

use super::args::ServeCommand;
use super::{Resolver, exit};

/// Runs `serve`; returns the exit code.
pub async fn command(resolver: &Resolver, args: ServeCommand, cancel: CancellationToken) -> i32 {
    let ServeCommand {
        provider,
        ingest,
        retry,
        serve,
        source,
        follow_table,
        console_addr,
        console_read_only,
        console_public_read,
        console_cookie_secure,
    } = args;
    let flags = FileConfig {
        provider: *provider,
        ingest: *ingest,
        retry: *retry,
        serve,
        source,
        ..Default::default()
    };
    let resolved = resolver.settings(flags).and_then(|s| Ok((s.ingest()?, s.redis_client()?, s)));
    let (ingest, redis, settings) = match resolved {
        Ok(r) => r,
        Err(e) => return exit::usage(&e),
    };
    super::warn_missing_api_key(&settings);
    let mut mounted = None;
    if let Some(listen) = console_addr {
        let token = match super::console::token_from_env() {
            Ok(t) => t,
            Err(e) => return exit::fail(exit::USAGE, &e),
        };
        let console = ConsoleConfig {
            listen,
            read_only: console_read_only,
            public_read: console_public_read,
            cookie_secure: console_cookie_secure,
            token,
            source: settings.source.as_ref().map(|s| (s.streams.clone(), s.group.clone())),
            ..Default::default()
        };
        if let Err(e) = console.check() {
            return exit::fail(exit::USAGE, &e.to_string());
        }
        mounted = Some(MountedConsole { config: console, redis: redis.clone() });
    }
    if follow_table.len() > embed_dlq::serve::MAX_TABLE_FOLLOWERS {
        return exit::fail(
            exit::USAGE,
            &format!("--follow-table: at most {} sources a process", embed_dlq::serve::MAX_TABLE_FOLLOWERS),
        );
    }
    run(&settings, mounted, ingest, redis, &follow_table, cancel).await
}

/// The table sources named, each aimed at every live revision of its own target.
async fn table_followers(
    ingest: &IngestSettings,
    names: &[String],
) -> Result<Vec<embed_dlq::serve::TableFollower>, String> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let pool = embed_dlq::store::connect(&ingest.database_url, 1).await.map_err(|e| e.to_string())?;
    let mut followers = Vec::with_capacity(names.len());
    for name in names {
        let source = embed_dlq::store::table_source::load(&pool, name).await.map_err(|e| e.to_string())?;
        let mut settings = ingest.clone();
        settings.table = source.target_table.clone();
        settings.options.progress = false;
        // A table source deletes what its table deletes: no corpus cleanup.
        settings.options.cleanup = embed_dlq::ingest::CleanupOptions::default();
        followers.push(embed_dlq::serve::TableFollower {
            source,
            targets: std::sync::Arc::new(settings.source_targets()),
        });
    }
    pool.close().await;
    Ok(followers)
}

/// Builds the pipeline and runs the service.
async fn run(
    settings: &Settings,
    console: Option<MountedConsole>,
    ingest: IngestSettings,
    redis: RedisClient,
    follow_table: &[String],
    cancel: CancellationToken,
) -> i32 {
    let mut config = ServeConfig::from_settings(settings);
    config.table_followers = match table_followers(&ingest, follow_table).await {
        Ok(f) => f,
        Err(e) => return exit::fail(exit::USAGE, &format!("--follow-table: {e}")),
    };
    let ingest = config.pipeline_settings(ingest);
    let source_targets: Option<std::sync::Arc<dyn embed_dlq::ingest::source::SourceTargets>> =
        config.source.is_some().then(|| {
            let mut source = ingest.clone();
            source.options = config.source_ingest.clone();
            std::sync::Arc::new(source.source_targets()) as _
        });
    let pipeline = match ingest.pipeline().await {
        Ok(p) => p,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    if let Some(addr) = settings.serve.metrics_addr
        && let Err(e) = embed_dlq::metrics::install(addr)
    {
        return exit::fail(exit::FAILURE, &e.to_string());
    }
    match embed_dlq::serve::serve_with_console(
        pipeline.store,
        pipeline.embedder,
        redis,
        config,
        console,
        source_targets,
        cancel,
    )
    .await
    {
        Ok(()) => exit::OK,
        // The configuration does not fit the streams: a usage error, nothing ran.
        Err(e @ (embed_dlq::serve::ServeError::Shards(_) | embed_dlq::serve::ServeError::Prefix(_))) => {
            exit::fail(exit::USAGE, &e.to_string())
        }
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}
