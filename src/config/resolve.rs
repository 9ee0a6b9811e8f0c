//! Resolution: each value from the command line, else the file, else the default, checked
//! against its bound, section by section, into the runtime types.

use super::*;

/// Picks each value from the command line layer, then the file, then the default, and
/// checks it against its bound.
#[derive(Clone, Copy)]
pub(super) struct Resolver<'a> {
    origins: &'a Origins,
    file_path: Option<&'a Path>,
    /// The file section of the keys being resolved, e.g. `retry` (named in file origins).
    section: &'static str,
    /// Where the bound each key is checked against is written down, when asked
    /// ([`help_bounds`]): the help and the reference show the very bound that is enforced.
    noted: Option<&'a std::cell::RefCell<Vec<(&'static str, String)>>>,
}

impl Resolver<'_> {
    /// Writes down `key`'s bound (a later note of the same key wins).
    fn note(&self, key: &'static str, bound: impl FnOnce() -> String) {
        if let Some(noted) = self.noted {
            noted.borrow_mut().push((key, bound()));
        }
    }

    /// The same layers, resolving the keys of file section `section`.
    fn section(self, section: &'static str) -> Self {
        Resolver { section, ..self }
    }

    fn pick<T>(&self, key: &str, flag: Option<T>, file: Option<T>) -> Option<(T, Origin)> {
        if let Some(v) = flag {
            return Some((v, self.origins.of_flag(key)));
        }
        let v = file?;
        let path = self.file_path.map(Path::to_path_buf).unwrap_or_default();
        Some((v, Origin::File { path, key: format!("[{}] {key}", self.section) }))
    }

    /// A number within `range` (which the default is in, by the unit tests).
    fn num<T: PartialOrd + fmt::Display + Copy>(
        &self,
        key: &'static str,
        flag: Option<T>,
        file: Option<T>,
        default: T,
        range: RangeInclusive<T>,
    ) -> Result<T, ConfigError> {
        self.note(key, || format!("{}..={}", range.start(), range.end()));
        match self.pick(key, flag, file) {
            None => Ok(default),
            Some((v, _)) if range.contains(&v) => Ok(v),
            Some((v, origin)) => Err(ConfigError::OutOfRange {
                setting: key,
                value: v.to_string(),
                origin,
                allowed: format!("{}..={}", range.start(), range.end()),
            }),
        }
    }

    /// An optional number within `range`.
    fn num_opt<T: PartialOrd + fmt::Display + Copy>(
        &self,
        key: &'static str,
        flag: Option<T>,
        file: Option<T>,
        range: RangeInclusive<T>,
    ) -> Result<Option<T>, ConfigError> {
        self.note(key, || format!("{}..={}", range.start(), range.end()));
        match self.pick(key, flag, file) {
            None => Ok(None),
            Some((v, _)) if range.contains(&v) => Ok(Some(v)),
            Some((v, origin)) => Err(ConfigError::OutOfRange {
                setting: key,
                value: v.to_string(),
                origin,
                allowed: format!("{}..={}", range.start(), range.end()),
            }),
        }
    }

    /// A string accepted by `check` (which says what is wrong otherwise).
    fn text(
        &self,
        key: &'static str,
        flag: Option<String>,
        file: Option<String>,
        check: impl Fn(&str) -> Result<(), String>,
    ) -> Result<Option<(String, Origin)>, ConfigError> {
        match self.pick(key, flag, file) {
            None => Ok(None),
            Some((v, origin)) => match check(&v) {
                Ok(()) => Ok(Some((v, origin))),
                Err(problem) => Err(ConfigError::Invalid { setting: key, origin, problem }),
            },
        }
    }
}

impl Settings {
    /// Resolves every setting: `flags` (the command line, environment values included, as
    /// clap parsed them) over `file` over the defaults; checks every value against its
    /// bound. `origins` tells flags from environment variables in error messages.
    pub fn resolve(
        flags: FileConfig,
        file: Option<&ConfigFile>,
        origins: &Origins,
    ) -> Result<Self, ConfigError> {
        Settings::resolve_noting(flags, file, origins, None)
    }

    /// [`Settings::resolve`], writing down every key's bound in `noted` if given.
    pub(super) fn resolve_noting(
        flags: FileConfig,
        file: Option<&ConfigFile>,
        origins: &Origins,
        noted: Option<&std::cell::RefCell<Vec<(&'static str, String)>>>,
    ) -> Result<Self, ConfigError> {
        let r = Resolver { origins, file_path: file.map(|f| f.path.as_path()), section: "", noted };
        let empty = FileConfig::default();
        let f = file.map(|f| &f.layer).unwrap_or(&empty);
        // Exhaustive destructuring here and in each section: a new field that is not resolved
        // does not compile (or warns as unused), so no setting can be silently ignored.
        let FileConfig { services, provider, ingest, retry, serve, source } = flags;
        let (database_url, redis_url, redis_cluster) =
            resolve_services(&r.section("services"), services, &f.services)?;
        let (client, api_key_env, limits, price_per_million_tokens) =
            resolve_provider(&r.section("provider"), provider, &f.provider)?;
        if limits.shared && redis_url.is_none() {
            return Err(ConfigError::Missing {
                setting: "redis_url",
                hint: "shared_limits keeps the provider budget in Redis: set REDIS_URL, --redis-url or [services] redis_url",
            });
        }
        let (table, options) = resolve_ingest(&r.section("ingest"), ingest, &f.ingest)?;
        let RetryParts { retry, breaker, dlq_schedule } =
            resolve_retry(&r.section("retry"), retry, &f.retry)?;
        let options = IngestOptions { dlq_schedule, price_per_million_tokens, ..options };
        let (stream_prefix, stream_shards, mut serve) =
            resolve_serve(&r.section("serve"), serve, &f.serve, dlq_schedule)?;
        // Replay's provider requests obey the same provider limits as ingest's.
        serve.replay.request_inputs = options.batch_max_inputs;
        serve.replay.request_chars = options.batch_max_chars;
        serve.replay.requests_in_flight = options.concurrency;
        let source = resolve_source(&r.section("source"), source, &f.source)?;
        Ok(Settings {
            source,
            database_url,
            redis_url,
            redis_cluster,
            table,
            stream_prefix,
            stream_shards,
            client,
            api_key_env,
            options,
            retry,
            breaker,
            serve,
            limits,
        })
    }
}

/// A client for `url` (one URL, or a comma-separated list of cluster nodes), in cluster mode
/// if `cluster` is set or the list has several URLs. `url` was checked by
/// [`Settings::resolve`]; the error never repeats it (it may hold a password).
pub(super) fn redis_client(url: &str, cluster: bool) -> Result<crate::streams::RedisClient, ConfigError> {
    crate::streams::open(url, cluster).map_err(|e| ConfigError::Invalid {
        setting: "redis_url",
        origin: Origin::Default,
        problem: format!("cannot be used: {}", e.category()),
    })
}

/// `[source]`: the stream source, `None` without streams.
pub(super) fn resolve_source(
    r: &Resolver<'_>,
    flags: SourceArgs,
    file: &SourceArgs,
) -> Result<Option<crate::ingest::source::SourceOptions>, ConfigError> {
    use crate::ingest::source::{DEFAULT_GROUP, SourceOptions};
    let SourceArgs {
        streams,
        source_shards,
        group,
        consumer,
        source_min_idle_ms,
        source_delivery_cap,
        source_max_inflight_entries,
    } = flags;
    let d = SourceOptions::default();
    r.note("streams", || {
        use crate::ingest::{reader::MAX_SOURCE_KEY_BYTES, source::MAX_SOURCE_STREAMS};
        format!("at most {MAX_SOURCE_STREAMS} keys of 1..={MAX_SOURCE_KEY_BYTES} bytes")
    });
    let streams = r.pick(
        "streams",
        Some(streams).filter(|s| !s.is_empty()),
        Some(file.streams.clone()).filter(|s| !s.is_empty()),
    );
    let shards = r.num("source_shards", source_shards, file.source_shards, 1, 1..=64)?;
    let name = |n: &str| check_len(n, bounds::SOURCE_NAME_CHARS).and(no_control(n));
    r.note("group", || chars(bounds::SOURCE_NAME_CHARS));
    r.note("consumer", || chars(bounds::SOURCE_NAME_CHARS));
    let group = r
        .text("group", group, file.group.clone(), name)?
        .map_or_else(|| DEFAULT_GROUP.to_string(), |(v, _)| v);
    let consumer =
        r.text("consumer", consumer, file.consumer.clone(), name)?.map_or(d.consumer.clone(), |(v, _)| v);
    let min_idle_ms = r.num(
        "source_min_idle_ms",
        source_min_idle_ms,
        file.source_min_idle_ms,
        millis(d.min_idle),
        bounds::MIN_IDLE_MS,
    )?;
    let delivery_cap = r.num(
        "source_delivery_cap",
        source_delivery_cap,
        file.source_delivery_cap,
        d.delivery_cap,
        bounds::DELIVERY_CAP,
    )?;
    let max_inflight = r.num(
        "source_max_inflight_entries",
        source_max_inflight_entries,
        file.source_max_inflight_entries,
        d.max_inflight_entries,
        1..=1_000_000,
    )?;
    let Some((streams, origin)) = streams else { return Ok(None) };
    let streams = match shards {
        1 => streams,
        n if streams.len() == 1 => (0..n).map(|i| format!("{}:{i}", streams[0])).collect(),
        _ => {
            return Err(ConfigError::Invalid {
                setting: "source_shards",
                origin,
                problem: "shards take exactly one stream key".into(),
            });
        }
    };
    let opts = SourceOptions {
        streams,
        group,
        consumer,
        min_idle: Duration::from_millis(min_idle_ms),
        delivery_cap,
        max_inflight_entries: max_inflight,
        ..d
    };
    if let Some(problem) = opts.problem() {
        return Err(ConfigError::Invalid { setting: "streams", origin, problem });
    }
    Ok(Some(opts))
}

/// `[services]`: the Postgres and Redis URLs (no defaults: a command that needs one says so)
/// and whether Redis is a cluster.
pub(super) fn resolve_services(
    r: &Resolver<'_>,
    flags: ServiceArgs,
    file: &ServiceArgs,
) -> Result<(Option<String>, Option<String>, bool), ConfigError> {
    let ServiceArgs { database_url, redis_url, redis_cluster } = flags;
    let database_url = r
        .text("database_url", database_url, file.database_url.clone(), |u| {
            check_scheme(u, &["postgres", "postgresql"])
        })?
        .map(|(v, _)| v);
    let redis_url = r.text("redis_url", redis_url, file.redis_url.clone(), check_redis_urls)?;
    let redis_cluster = r.pick("redis_cluster", redis_cluster, file.redis_cluster);
    if let (Some((true, origin)), Some((url, _))) = (&redis_cluster, &redis_url)
        && crate::streams::conn::split_urls(url).iter().any(|u| is_unix_socket(u))
    {
        return Err(ConfigError::Invalid {
            setting: "redis_cluster",
            origin: origin.clone(),
            problem: "a Redis Cluster is reached over TCP, not a unix socket".into(),
        });
    }
    let redis_cluster = redis_cluster.is_some_and(|(c, _)| c);
    Ok((database_url, redis_url.map(|(v, _)| v), redis_cluster))
}

/// `[provider]`: the provider client, with the API key read from the variable it names (and
/// that name), the provider budgets, and the price of a million tokens (for the summary's
/// cost figures).
pub(super) fn resolve_provider(
    r: &Resolver<'_>,
    flags: ProviderArgs,
    file: &ProviderArgs,
) -> Result<(ClientConfig, String, LimitConfig, Option<f64>), ConfigError> {
    let ProviderArgs {
        base_url,
        model,
        request_dimensions,
        encoding_format,
        api_key_env,
        api_key_header,
        headers,
        request_timeout_ms,
        max_requests_per_minute,
        max_tokens_per_minute,
        shared_limits,
        price_per_million_tokens,
    } = flags;
    let base_url = r
        .text("base_url", base_url, file.base_url.clone(), check_base_url)?
        .map_or_else(|| DEFAULT_BASE_URL.to_string(), |(v, _)| v);
    r.note("model", || chars(bounds::MODEL_CHARS));
    let model = r
        .text("model", model, file.model.clone(), |m| check_len(m, bounds::MODEL_CHARS).and(no_control(m)))?
        .map_or_else(|| DEFAULT_MODEL.to_string(), |(v, _)| v);
    let request_dimensions =
        r.num_opt("request_dimensions", request_dimensions, file.request_dimensions, bounds::DIMENSIONS)?;
    let encoding = r
        .pick("encoding_format", encoding_format, file.encoding_format)
        .map_or(EncodingFormat::Base64, |(v, _)| v);
    let key_env = r
        .text("api_key_env", api_key_env, file.api_key_env.clone(), check_env_name)?
        .map_or_else(|| DEFAULT_API_KEY_ENV.to_string(), |(v, _)| v);
    let api_key = std::env::var(&key_env).ok().filter(|k| !k.is_empty());
    let api_key_header = r
        .text("api_key_header", api_key_header, file.api_key_header.clone(), check_header_name)?
        .map(|(v, _)| v);
    let headers = r.pick(
        "headers",
        Some(headers).filter(|h| !h.is_empty()),
        Some(file.headers.clone()).filter(|h| !h.is_empty()),
    );
    let extra_headers = match headers {
        Some((headers, origin)) => parse_headers(&headers, &origin)?,
        None => Vec::new(),
    };
    let timeout_ms = r.num(
        "request_timeout_ms",
        request_timeout_ms,
        file.request_timeout_ms,
        DEFAULT_REQUEST_TIMEOUT_MS,
        bounds::REQUEST_TIMEOUT_MS,
    )?;
    let limits = resolve_limits(r, (max_requests_per_minute, max_tokens_per_minute, shared_limits), file)?;
    let price = r.num_opt(
        "price_per_million_tokens",
        price_per_million_tokens,
        file.price_per_million_tokens,
        bounds::PRICE_PER_MILLION_TOKENS,
    )?;
    let client = ClientConfig {
        base_url,
        model,
        request_dimensions,
        encoding,
        api_key,
        api_key_header,
        extra_headers,
        timeout: Duration::from_millis(timeout_ms),
    };
    Ok((client, key_env, limits, price))
}

/// The `[provider]` budgets: off unless set; shared only with a budget to share.
pub(super) fn resolve_limits(
    r: &Resolver<'_>,
    (rpm, tpm, shared): (Option<u32>, Option<u32>, Option<bool>),
    file: &ProviderArgs,
) -> Result<LimitConfig, ConfigError> {
    let max_requests_per_minute = r.num_opt(
        "max_requests_per_minute",
        rpm,
        file.max_requests_per_minute,
        bounds::MAX_REQUESTS_PER_MINUTE,
    )?;
    let max_tokens_per_minute =
        r.num_opt("max_tokens_per_minute", tpm, file.max_tokens_per_minute, bounds::MAX_TOKENS_PER_MINUTE)?;
    let limits = LimitConfig { max_requests_per_minute, max_tokens_per_minute, shared: false };
    match r.pick("shared_limits", shared, file.shared_limits) {
        Some((true, origin)) if !limits.any() => Err(ConfigError::Invalid {
            setting: "shared_limits",
            origin,
            problem: "there is no budget to share: set max_requests_per_minute or max_tokens_per_minute"
                .into(),
        }),
        Some((shared, _)) => Ok(LimitConfig { shared, ..limits }),
        None => Ok(limits),
    }
}

/// The extra `Name: value` headers, checked here so that a bad one fails the command instead
/// of every request.
pub(super) fn parse_headers(
    headers: &[String],
    origin: &Origin,
) -> Result<Vec<(String, String)>, ConfigError> {
    let invalid =
        |problem: String| ConfigError::Invalid { setting: "headers", origin: origin.clone(), problem };
    if headers.len() > bounds::MAX_HEADERS {
        return Err(invalid(format!("{} headers; at most {}", headers.len(), bounds::MAX_HEADERS)));
    }
    let mut parsed = Vec::with_capacity(headers.len());
    for h in headers {
        let (name, value) =
            h.split_once(':').ok_or_else(|| invalid(format!("{h:?} is not `Name: value`")))?;
        let (name, value) = (name.trim(), value.trim());
        check_header_name(name).map_err(&invalid)?;
        reqwest::header::HeaderValue::from_str(value).map_err(|_| {
            invalid(format!("the value of header {name:?} has characters not allowed in a header"))
        })?;
        parsed.push((name.to_string(), value.to_string()));
    }
    Ok(parsed)
}

/// `[ingest]`: the target table and the ingest options (with the default DLQ schedule, which
/// `[retry]` sets).
pub(super) fn resolve_ingest(
    r: &Resolver<'_>,
    flags: IngestArgs,
    file: &IngestArgs,
) -> Result<(String, IngestOptions), ConfigError> {
    let IngestArgs {
        table,
        batch_max_inputs,
        batch_max_chars,
        concurrency,
        writers,
        max_input_chars,
        max_line_bytes,
        max_inflight_bytes,
        on_outage,
        lease_secs,
        on_newer_parked,
        cleanup,
        cleanup_max_fraction,
        cleanup_max_rejected_lines,
    } = flags;
    let table = r
        .text("table", table, file.table.clone(), check_table)?
        .map_or_else(|| DEFAULT_TABLE.to_string(), |(v, _)| v);
    let d = IngestOptions::default();
    let batch_max_inputs = r.num(
        "batch_max_inputs",
        batch_max_inputs,
        file.batch_max_inputs,
        d.batch_max_inputs,
        bounds::BATCH_MAX_INPUTS,
    )?;
    let batch_max_chars = r.num(
        "batch_max_chars",
        batch_max_chars,
        file.batch_max_chars,
        d.batch_max_chars,
        bounds::BATCH_MAX_CHARS,
    )?;
    let concurrency =
        r.num("concurrency", concurrency, file.concurrency, d.concurrency, bounds::CONCURRENCY)?;
    let writers = r.num("writers", writers, file.writers, d.writers, bounds::WRITERS)?;
    let max_input_chars = r.num(
        "max_input_chars",
        max_input_chars,
        file.max_input_chars,
        d.max_input_chars,
        bounds::MAX_INPUT_CHARS,
    )?;
    let max_line_bytes = r.num(
        "max_line_bytes",
        max_line_bytes,
        file.max_line_bytes,
        d.max_line_bytes,
        bounds::MAX_LINE_BYTES,
    )?;
    let max_inflight_bytes = r.num(
        "max_inflight_bytes",
        max_inflight_bytes,
        file.max_inflight_bytes,
        d.max_inflight_bytes,
        bounds::MAX_INFLIGHT_BYTES,
    )?;
    // An enum: serde and clap reject anything but wait, park or stop.
    let on_outage = r.pick("on_outage", on_outage, file.on_outage).map_or(d.on_outage, |(v, _)| v);
    let lease_secs =
        r.num("lease_secs", lease_secs, file.lease_secs, d.lease.as_secs(), bounds::LEASE_SECS)?;
    // An enum: serde and clap reject anything but withdraw or keep.
    let on_newer_parked = r
        .pick("on_newer_parked", on_newer_parked, file.on_newer_parked)
        .map_or(d.on_newer_parked, |(v, _)| v);
    // An enum: serde and clap reject anything but none, incremental or full.
    let cleanup_mode = r.pick("cleanup", cleanup, file.cleanup).map_or(d.cleanup.mode, |(v, _)| v);
    let max_fraction = r.num(
        "cleanup_max_fraction",
        cleanup_max_fraction,
        file.cleanup_max_fraction,
        d.cleanup.max_fraction,
        bounds::CLEANUP_MAX_FRACTION,
    )?;
    let max_rejected_lines = r.num(
        "cleanup_max_rejected_lines",
        cleanup_max_rejected_lines,
        file.cleanup_max_rejected_lines,
        d.cleanup.max_rejected_lines,
        bounds::CLEANUP_MAX_REJECTED_LINES,
    )?;
    let options = IngestOptions {
        batch_max_inputs,
        batch_max_chars,
        concurrency,
        writers,
        max_input_chars,
        max_line_bytes,
        max_inflight_bytes,
        on_outage,
        lease: Duration::from_secs(lease_secs),
        on_newer_parked,
        cleanup: crate::ingest::CleanupOptions {
            mode: cleanup_mode,
            max_fraction,
            max_rejected_lines,
            ..d.cleanup.clone()
        },
        ..d
    };
    Ok((table, options))
}

/// What `[retry]` resolves to: the in-process policy, the breaker, and the DLQ schedule that
/// both the ingest and the replayers follow.
pub(super) struct RetryParts {
    retry: RetryPolicy,
    breaker: BreakerConfig,
    dlq_schedule: DlqSchedule,
}

/// `[retry]`: in-process retries, the DLQ schedule and the circuit breaker.
pub(super) fn resolve_retry(
    r: &Resolver<'_>,
    flags: RetryArgs,
    file: &RetryArgs,
) -> Result<RetryParts, ConfigError> {
    let RetryArgs {
        retry_max_attempts,
        retry_base_ms,
        retry_cap_ms,
        dlq_base_secs,
        dlq_cap_secs,
        dlq_max_replays,
        breaker_failure_threshold,
        breaker_cooldown_ms,
        max_outage_secs,
    } = flags;
    let retry = resolve_retry_policy(r, file, retry_max_attempts, retry_base_ms, retry_cap_ms)?;
    let dlq_schedule = resolve_dlq_schedule(r, file, dlq_base_secs, dlq_cap_secs, dlq_max_replays)?;
    let breaker = resolve_breaker(r, file, breaker_failure_threshold, breaker_cooldown_ms, max_outage_secs)?;
    Ok(RetryParts { retry, breaker, dlq_schedule })
}

/// The in-process retry policy. The cap's lower bound is the base, so the base comes first.
pub(super) fn resolve_retry_policy(
    r: &Resolver<'_>,
    file: &RetryArgs,
    retry_max_attempts: Option<u32>,
    retry_base_ms: Option<u64>,
    retry_cap_ms: Option<u64>,
) -> Result<RetryPolicy, ConfigError> {
    let rp = RetryPolicy::default();
    let retry_max_attempts = r.num(
        "retry_max_attempts",
        retry_max_attempts,
        file.retry_max_attempts,
        rp.max_attempts,
        bounds::RETRY_MAX_ATTEMPTS,
    )?;
    let retry_base_ms =
        r.num("retry_base_ms", retry_base_ms, file.retry_base_ms, millis(rp.base), bounds::RETRY_BASE_MS)?;
    let retry_cap_ms = r.num(
        "retry_cap_ms",
        retry_cap_ms,
        file.retry_cap_ms,
        millis(rp.cap),
        retry_base_ms..=*bounds::RETRY_CAP_MS.end(),
    )?;
    r.note("retry_cap_ms", || format!("retry_base_ms..={}", bounds::RETRY_CAP_MS.end()));
    Ok(RetryPolicy {
        max_attempts: retry_max_attempts,
        base: Duration::from_millis(retry_base_ms),
        cap: Duration::from_millis(retry_cap_ms),
        ..rp
    })
}

/// The DLQ replay schedule. The cap's lower bound is the base, so the base comes first.
pub(super) fn resolve_dlq_schedule(
    r: &Resolver<'_>,
    file: &RetryArgs,
    dlq_base_secs: Option<u64>,
    dlq_cap_secs: Option<u64>,
    dlq_max_replays: Option<u32>,
) -> Result<DlqSchedule, ConfigError> {
    let ds = DlqSchedule::default();
    let dlq_base_secs =
        r.num("dlq_base_secs", dlq_base_secs, file.dlq_base_secs, ds.base.as_secs(), bounds::DLQ_BASE_SECS)?;
    let dlq_cap_secs = r.num(
        "dlq_cap_secs",
        dlq_cap_secs,
        file.dlq_cap_secs,
        ds.cap.as_secs(),
        dlq_base_secs..=*bounds::DLQ_CAP_SECS.end(),
    )?;
    r.note("dlq_cap_secs", || format!("dlq_base_secs..={}", bounds::DLQ_CAP_SECS.end()));
    let dlq_max_replays = r.num(
        "dlq_max_replays",
        dlq_max_replays,
        file.dlq_max_replays,
        ds.max_replays,
        bounds::DLQ_MAX_REPLAYS,
    )?;
    Ok(DlqSchedule {
        base: Duration::from_secs(dlq_base_secs),
        cap: Duration::from_secs(dlq_cap_secs),
        max_replays: dlq_max_replays,
        ..ds
    })
}

/// The circuit breaker shared by every request of a process.
pub(super) fn resolve_breaker(
    r: &Resolver<'_>,
    file: &RetryArgs,
    breaker_failure_threshold: Option<u32>,
    breaker_cooldown_ms: Option<u64>,
    max_outage_secs: Option<u64>,
) -> Result<BreakerConfig, ConfigError> {
    let bd = BreakerConfig::default();
    let breaker_failure_threshold = r.num(
        "breaker_failure_threshold",
        breaker_failure_threshold,
        file.breaker_failure_threshold,
        bd.failure_threshold,
        bounds::BREAKER_FAILURE_THRESHOLD,
    )?;
    let breaker_cooldown_ms = r.num(
        "breaker_cooldown_ms",
        breaker_cooldown_ms,
        file.breaker_cooldown_ms,
        millis(bd.cooldown),
        bounds::BREAKER_COOLDOWN_MS,
    )?;
    let max_outage_secs = r.num(
        "max_outage_secs",
        max_outage_secs,
        file.max_outage_secs,
        bd.max_outage.as_secs(),
        bounds::MAX_OUTAGE_SECS,
    )?;
    Ok(BreakerConfig {
        failure_threshold: breaker_failure_threshold,
        cooldown: Duration::from_millis(breaker_cooldown_ms),
        max_outage: Duration::from_secs(max_outage_secs),
        ..bd
    })
}

/// `[serve]`: the stream prefix and shard count (which every Redis-facing command uses) and the settings of
/// `serve`, whose replayers follow `dlq_schedule`.
pub(super) fn resolve_serve(
    r: &Resolver<'_>,
    flags: ServeArgs,
    file: &ServeArgs,
    dlq_schedule: DlqSchedule,
) -> Result<(String, u16, ServeSettings), ConfigError> {
    let ServeArgs {
        replayers,
        replay_batch,
        min_idle_ms,
        delivery_cap,
        replay_lease_secs,
        replay_outstanding_max,
        grace_ms,
        stream_prefix,
        stream_shards,
        consumer_name,
        relay_batch,
        relay_poll_ms,
        relay_marker_ttl_secs,
        events_maxlen,
        metrics_addr,
        reconcile_every_secs,
        reconcile_full_every_secs,
        reconcile_deep_every_secs,
    } = flags;
    let rd = ReplayConfig::default();
    let ld = RelayConfig::default();
    let stream_prefix = r
        .text("stream_prefix", stream_prefix, file.stream_prefix.clone(), check_stream_prefix)?
        .map_or_else(|| DEFAULT_STREAM_PREFIX.to_string(), |(v, _)| v);
    let stream_shards = r.num(
        "stream_shards",
        stream_shards,
        file.stream_shards,
        DEFAULT_STREAM_SHARDS,
        bounds::STREAM_SHARDS,
    )?;
    r.note("consumer_name", || chars(bounds::NAME_CHARS));
    r.note("stream_prefix", || chars(bounds::NAME_CHARS));
    let consumer_prefix = r
        .text("consumer_name", consumer_name, file.consumer_name.clone(), |n| {
            check_len(n, bounds::NAME_CHARS).and(no_control(n))
        })?
        .map(|(v, _)| v);
    let replayers = r.num("replayers", replayers, file.replayers, DEFAULT_REPLAYERS, bounds::REPLAYERS)?;
    let replay_batch =
        r.num("replay_batch", replay_batch, file.replay_batch, rd.batch, bounds::REPLAY_BATCH)?;
    let min_idle_ms =
        r.num("min_idle_ms", min_idle_ms, file.min_idle_ms, millis(rd.min_idle), bounds::MIN_IDLE_MS)?;
    let delivery_cap =
        r.num("delivery_cap", delivery_cap, file.delivery_cap, rd.delivery_cap, bounds::DELIVERY_CAP)?;
    let replay_lease_secs = r.num(
        "replay_lease_secs",
        replay_lease_secs,
        file.replay_lease_secs,
        rd.lease.as_secs(),
        bounds::REPLAY_LEASE_SECS,
    )?;
    let replay_outstanding_max = r.num(
        "replay_outstanding_max",
        replay_outstanding_max,
        file.replay_outstanding_max,
        rd.outstanding_max,
        bounds::REPLAY_OUTSTANDING_MAX,
    )?;
    let grace_ms = r.num("grace_ms", grace_ms, file.grace_ms, DEFAULT_GRACE_MS, bounds::GRACE_MS)?;
    let relay_batch = r.num("relay_batch", relay_batch, file.relay_batch, ld.batch, bounds::RELAY_BATCH)?;
    let relay_poll_ms =
        r.num("relay_poll_ms", relay_poll_ms, file.relay_poll_ms, millis(ld.poll), bounds::RELAY_POLL_MS)?;
    let marker_ttl_secs = r.num(
        "relay_marker_ttl_secs",
        relay_marker_ttl_secs,
        file.relay_marker_ttl_secs,
        ld.marker_ttl.as_secs(),
        bounds::RELAY_MARKER_TTL_SECS,
    )?;
    let events_maxlen =
        r.num("events_maxlen", events_maxlen, file.events_maxlen, ld.events_maxlen, bounds::EVENTS_MAXLEN)?;
    let metrics_addr = r.pick("metrics_addr", metrics_addr, file.metrics_addr).map(|(v, _)| v);
    let reconcile_every_secs = r.num(
        "reconcile_every_secs",
        reconcile_every_secs,
        file.reconcile_every_secs,
        DEFAULT_RECONCILE_EVERY_SECS,
        bounds::RECONCILE_EVERY_SECS,
    )?;
    let full_every = r.num(
        "reconcile_full_every_secs",
        reconcile_full_every_secs,
        file.reconcile_full_every_secs,
        crate::reconcile::DEFAULT_FULL_EVERY.as_secs(),
        bounds::RECONCILE_FULL_EVERY_SECS,
    )?;
    let deep_every = r.num(
        "reconcile_deep_every_secs",
        reconcile_deep_every_secs,
        file.reconcile_deep_every_secs,
        crate::reconcile::DEFAULT_DEEP_EVERY.as_secs(),
        bounds::RECONCILE_DEEP_EVERY_SECS,
    )?;
    let serve = ServeSettings {
        replayers,
        replay: ReplayConfig {
            batch: replay_batch,
            min_idle: Duration::from_millis(min_idle_ms),
            delivery_cap,
            lease: Duration::from_secs(replay_lease_secs),
            outstanding_max: replay_outstanding_max,
            schedule: dlq_schedule,
            ..rd
        },
        relay: RelayConfig {
            batch: relay_batch,
            replay_maxlen: replay_outstanding_max,
            poll: Duration::from_millis(relay_poll_ms),
            marker_ttl: Duration::from_secs(marker_ttl_secs),
            events_maxlen,
            ..ld
        },
        grace: Duration::from_millis(grace_ms),
        consumer_prefix,
        metrics_addr,
        reconcile_every: (reconcile_every_secs > 0).then(|| Duration::from_secs(reconcile_every_secs)),
        reconcile_sweeps: SweepPolicy::Scheduled {
            full_every: Duration::from_secs(full_every),
            deep_every: (deep_every > 0).then(|| Duration::from_secs(deep_every)),
        },
    };
    Ok((stream_prefix, stream_shards, serve))
}

/// A length bound in characters, as the help shows it.
pub(super) fn chars(range: RangeInclusive<usize>) -> String {
    format!("{}..={} characters", range.start(), range.end())
}
