//! The settings of an ingest, and the pipeline built from them.

use super::*;

/// Validated runtime settings of an ingest. Its `Debug` hides the database password.
#[derive(Clone)]
pub struct IngestSettings {
    /// Postgres URL (may hold a password).
    pub database_url: String,
    /// Target vector table; [`IngestSettings::pipeline`] checks that it exists and fits.
    pub table: String,
    /// How to reach the provider.
    pub client: ClientConfig,
    /// Batching, concurrency and memory bounds.
    pub options: IngestOptions,
    /// In-process retries before a chunk is parked.
    pub retry: RetryPolicy,
    /// Circuit breaker and outage limit.
    pub breaker: BreakerConfig,
    /// Provider budgets; [`IngestSettings::pipeline`] puts one limiter in front of the client.
    pub limits: LimitConfig,
    /// Redis URL (may hold a password), needed only by shared limits.
    pub redis_url: Option<String>,
    /// Redis Cluster mode (see [`Settings::redis_cluster`]).
    pub redis_cluster: bool,
}

impl fmt::Debug for IngestSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IngestSettings")
            .field("database_url", &redact_password(&self.database_url))
            .field("table", &self.table)
            .field("client", &self.client)
            .field("options", &self.options)
            .field("retry", &self.retry)
            .field("breaker", &self.breaker)
            .field("limits", &self.limits)
            .field("redis_url", &self.redis_url.as_deref().map(redact_password))
            .field("redis_cluster", &self.redis_cluster)
            .finish()
    }
}

impl IngestSettings {
    /// For library callers (tests, demo, benchmarks): the given groups over `file` over the
    /// defaults, validated like the command line.
    pub fn resolve(
        services: ServiceArgs,
        provider: ProviderArgs,
        ingest: IngestArgs,
        retry: RetryArgs,
        file: Option<FileConfig>,
    ) -> Result<Self, ConfigError> {
        let flags = FileConfig {
            services,
            provider,
            ingest,
            retry,
            serve: ServeArgs::default(),
            source: SourceArgs::default(),
        };
        let file = file.map(|layer| ConfigFile { path: PathBuf::from("<config>"), layer });
        Settings::resolve(flags, file.as_ref(), &Origins::default())?.ingest()
    }
}

/// Why a pipeline could not be built from valid settings: the services or the target table,
/// never the settings themselves (those are checked by [`Settings::resolve`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// Postgres did not accept a connection.
    #[error("cannot connect to Postgres: {0}")]
    Connect(#[source] crate::store::StoreError),
    /// The migrations failed, or the target table is missing or does not fit.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The provider client could not be built (e.g. its TLS stack).
    #[error("{0}")]
    Client(String),
}

impl IngestSettings {
    /// The pipeline these settings describe: a pool sized for the workers and writers, the
    /// migrated store bound to its table and model, the provider client, one shared gate.
    /// Every ingest (the command, `serve`, the demo, the tests, the benchmark) starts here,
    /// so they all run the same wiring.
    pub async fn pipeline(&self) -> Result<crate::ingest::Pipeline, PipelineError> {
        use crate::store;
        let options = self.options.within_bounds();
        // The intake: a window's claim and a position reservation beside it; its read-only
        // lookups, one for each window in flight, have a pool of their own.
        let connections = (options.concurrency + options.writers) as u32 + 2;
        let pool = store::connect(&self.database_url, connections).await.map_err(PipelineError::Connect)?;
        let lookups =
            store::connect_generic_plans(&self.database_url, crate::ingest::WINDOWS_IN_FLIGHT as u32)
                .map_err(PipelineError::Connect)?;
        store::migrate(&pool).await?;
        let store = store::Store::open(pool, &self.table)
            .await?
            .with_model(&self.client.model, self.client.request_dimensions)
            .with_on_newer_parked(options.on_newer_parked)
            .with_lookup_pool(lookups);
        let client = crate::embed::client::EmbedClient::new(self.client.clone())
            .map_err(PipelineError::Client)?
            .with_limiter(std::sync::Arc::new(self.limiter().await?));
        let embedder = crate::embed::Embedder {
            client,
            gate: std::sync::Arc::new(crate::embed::gate::ProviderGate::new(self.breaker)),
            policy: self.retry,
            dimensions: store.target().dimensions,
            // Replay waits out an outage; an ingest's workers apply `options.on_outage`.
            on_outage: crate::embed::gate::OnOutage::Wait,
            isolation: Default::default(),
            revision: store.target().revision,
        };
        Ok(crate::ingest::Pipeline { store, embedder, options: self.options.clone() })
    }
}

impl IngestSettings {
    /// The pipelines of every live revision of the target these settings name (the active
    /// one first), each with that revision's identity, model and `dimensions` request
    /// parameter (a revision 1 adopted without a recorded model embeds with these
    /// settings' model); `None` when the table is not a target with revisions, which
    /// [`IngestSettings::pipeline`] writes alone.
    pub async fn fanout(&self) -> Result<Option<crate::ingest::Fanout>, PipelineError> {
        let live = self.live_revisions().await?;
        if live.len() < 2 {
            return Ok(None);
        }
        let mut revisions = Vec::with_capacity(live.len());
        for (n, revision) in live.into_iter().enumerate() {
            let mut settings = self.for_revision(&revision);
            // One progress bar: the active revision's.
            settings.options.progress &= n == 0;
            revisions.push((revision, settings.pipeline().await?));
        }
        let (active, pipeline) = &revisions[0];
        let fill =
            crate::store::revision::lacks_text_hashes(pipeline.store.pool(), active).await?.then(|| {
                crate::ingest::TextHashFill {
                    store: pipeline.store.clone(),
                    revision: active.clone(),
                    model: pipeline.embedder.client.model().to_string(),
                    dimensions: pipeline.embedder.dimensions,
                }
            });
        Ok(Some(crate::ingest::Fanout { revisions, fill }))
    }

    /// What a backfill (`revision backfill`) writes: every live revision but the active one,
    /// each run copying the active revision's records ([`crate::ingest::CopyOf`]: a line only
    /// where the active revision holds that very text, at its record's position), the first
    /// one with the progress bar; `None` when the target has no revision besides the active
    /// one. Rows of the active revision from before text hashes get theirs recorded on the
    /// way ([`crate::ingest::TextHashFill`]), as a fan-out run does.
    pub async fn backfill(&self) -> Result<Option<crate::ingest::Fanout>, PipelineError> {
        let live = self.live_revisions().await?;
        let Some((active, shadows)) = live.split_first().filter(|(_, rest)| !rest.is_empty()) else {
            return Ok(None);
        };
        let active_settings = self.for_revision(active);
        let copy = std::sync::Arc::new(crate::ingest::CopyOf {
            identity: active.identity.clone(),
            model: active_settings.client.model.clone(),
            dimensions: usize::try_from(active.dimensions).unwrap_or(0),
        });
        let mut revisions = Vec::with_capacity(shadows.len());
        for (n, revision) in shadows.iter().enumerate() {
            let mut settings = self.for_revision(revision);
            settings.options.progress &= n == 0;
            settings.options.copy_of = Some(copy.clone());
            revisions.push((revision.clone(), settings.pipeline().await?));
        }
        let pool = revisions[0].1.store.pool();
        let fill = if crate::store::revision::lacks_text_hashes(pool, active).await? {
            let mut settings = active_settings;
            settings.options.progress = false;
            let pipeline = settings.pipeline().await?;
            Some(crate::ingest::TextHashFill {
                store: pipeline.store.clone(),
                revision: active.clone(),
                model: pipeline.embedder.client.model().to_string(),
                dimensions: pipeline.embedder.dimensions,
            })
        } else {
            None
        };
        Ok(Some(crate::ingest::Fanout { revisions, fill }))
    }

    /// These settings aimed at `revision`: its identity, and its model and `dimensions`
    /// request parameter where the registry records them. A revision 1 is a table the tool
    /// adopted, made by ingests with their own settings: without a recorded model it embeds
    /// with these settings' model, and without a recorded parameter it sends these settings'
    /// (`revision create --active-model` records the model alone; sending none would make the
    /// provider answer its native size, which the table refuses). A revision made by
    /// `revision create` sends exactly what it records.
    pub fn for_revision(&self, revision: &crate::store::revision::Revision) -> IngestSettings {
        let mut settings = self.clone();
        settings.table = revision.identity.clone();
        if let Some(model) = &revision.model {
            settings.client.model = model.clone();
            let recorded = revision.request_dimensions.map(|d| d as usize);
            settings.client.request_dimensions = match (revision.revision, recorded) {
                (1, None) => self.client.request_dimensions,
                _ => recorded,
            };
        }
        settings
    }

    /// These settings, aimed at the target's one live revision when it has exactly one (a
    /// target whose revision 1 was retired writes revision 2, with revision 2's model);
    /// unchanged for a plain table, or one with several live revisions
    /// ([`IngestSettings::fanout`] writes those).
    pub async fn aimed_at_live_revision(&self) -> Result<IngestSettings, PipelineError> {
        let live = self.live_revisions().await?;
        Ok(match live.as_slice() {
            [only] => self.for_revision(only),
            _ => self.clone(),
        })
    }

    /// What a stream source built from these settings writes: the pipelines of the target's
    /// live revisions, looked up for each segment ([`RevisionTargets`]).
    pub fn source_targets(&self) -> RevisionTargets {
        RevisionTargets { settings: self.clone(), built: tokio::sync::Mutex::default() }
    }

    /// The live revisions of the target these settings name ([`crate::store::revision::live`]).
    /// A database the migrations have not reached yet has no registry, so no revisions (the
    /// pipeline migrates it when it is built: not done twice here).
    pub async fn live_revisions(&self) -> Result<Vec<crate::store::revision::Revision>, PipelineError> {
        let pool = crate::store::connect(&self.database_url, 1).await.map_err(PipelineError::Connect)?;
        let live = crate::store::revision::live(&pool, &self.table).await;
        pool.close().await;
        match live {
            Err(crate::store::StoreError::Db(sqlx::Error::Database(e)))
                if e.code().as_deref() == Some("42P01") =>
            {
                Ok(Vec::new())
            }
            other => Ok(other?),
        }
    }

    /// The provider limiter of this pipeline: shared through Redis with `shared_limits`, else
    /// local to the process.
    async fn limiter(&self) -> Result<crate::embed::limit::ProviderLimiter, PipelineError> {
        use crate::embed::limit::ProviderLimiter;
        match (&self.redis_url, self.limits.shared) {
            (Some(url), true) => {
                let redis = redis_client(url, self.redis_cluster).map_err(|e| {
                    PipelineError::Client(format!("cannot set up the shared rate limit: {e}"))
                })?;
                ProviderLimiter::with_redis(self.limits, &redis, &self.client.base_url, &self.client.model)
                    .await
                    .map_err(|e| {
                        PipelineError::Client(format!("cannot set up the shared rate limit in Redis: {e}"))
                    })
            }
            _ => Ok(ProviderLimiter::local(self.limits)),
        }
    }
}

/// The pipelines a stream source writes for the target of its settings: one per live
/// revision (the active one first), or the table alone when it has none. Built once for each
/// set of revisions (identity and model), so that segments reuse their pools and limiters.
pub struct RevisionTargets {
    settings: IngestSettings,
    /// The set the pipelines were built for, and the pipelines.
    built: tokio::sync::Mutex<Option<(Vec<RevisionKey>, Vec<crate::ingest::source::SourceWriter>)>>,
}

/// What makes a set of revisions another one: its identities, states and models, in order.
type RevisionKey = (String, String, Option<String>);

fn revision_keys(live: &[crate::store::revision::Revision]) -> Vec<RevisionKey> {
    live.iter().map(|r| (r.identity.clone(), r.state.clone(), r.model.clone())).collect()
}

impl RevisionTargets {
    async fn build(&self) -> Result<Vec<crate::ingest::source::SourceWriter>, PipelineError> {
        use crate::ingest::source::SourceWriter;
        let live = self.settings.live_revisions().await?;
        let key = revision_keys(&live);
        let mut built = self.built.lock().await;
        if let Some((k, writers)) = built.as_ref()
            && *k == key
        {
            return Ok(writers.clone());
        }
        let mut writers = Vec::with_capacity(live.len().max(1));
        if live.is_empty() {
            writers.push(SourceWriter { revision: None, pipeline: self.settings.pipeline().await? });
        }
        for revision in live {
            let pipeline = self.settings.for_revision(&revision).pipeline().await?;
            writers.push(SourceWriter { revision: Some(revision), pipeline });
        }
        *built = Some((key, writers.clone()));
        Ok(writers)
    }
}

impl crate::ingest::source::SourceTargets for RevisionTargets {
    fn writers(
        &self,
    ) -> futures::future::BoxFuture<
        '_,
        Result<Vec<crate::ingest::source::SourceWriter>, crate::ingest::IngestError>,
    > {
        Box::pin(async {
            self.build().await.map_err(|e| {
                crate::ingest::IngestError::Source(crate::ingest::source::SourceError(format!(
                    "the target's revisions: {e}"
                )))
            })
        })
    }

    fn changed<'a>(
        &'a self,
        current: &'a [crate::ingest::source::SourceWriter],
    ) -> futures::future::BoxFuture<'a, bool> {
        Box::pin(async move {
            let Some(first) = current.first() else { return true };
            let live = crate::store::revision::live(first.pipeline.store.pool(), &self.settings.table).await;
            let Ok(live) = live else { return false };
            let now: Vec<RevisionKey> = revision_keys(&live);
            let was: Vec<RevisionKey> = current
                .iter()
                .filter_map(|w| w.revision.as_ref())
                .map(|r| (r.identity.clone(), r.state.clone(), r.model.clone()))
                .collect();
            now != was
        })
    }

    fn paused<'a>(
        &'a self,
        current: &'a [crate::ingest::source::SourceWriter],
    ) -> futures::future::BoxFuture<'a, bool> {
        Box::pin(async move {
            let Some(crate::ingest::source::SourceWriter { revision: Some(r), pipeline }) = current.first()
            else {
                return false;
            };
            crate::store::revision::intake_paused(pipeline.store.pool(), &r.target).await.unwrap_or(false)
        })
    }
}
