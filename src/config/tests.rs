use super::*;
use crate::store::park::OnNewerParked;

fn file(text: &str) -> ConfigFile {
    ConfigFile::parse(Path::new("/etc/e.toml"), text).unwrap()
}

fn resolve(flags: FileConfig, file: Option<&ConfigFile>) -> Result<Settings, ConfigError> {
    Settings::resolve(flags, file, &Origins::default())
}

#[test]
fn unknown_keys_are_rejected_naming_file_and_key() {
    let err = ConfigFile::parse(Path::new("/etc/e.toml"), "[provider]\nmodle = \"x\"\n").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("modle") && msg.contains("/etc/e.toml"), "{msg}");
    assert!(ConfigFile::parse(Path::new("x"), "[nope]\n").is_err());
    assert!(ConfigFile::parse(Path::new("x"), "[serve]\nreplayer = 1\n").is_err());
}

#[test]
fn the_events_stream_cap_is_a_bounded_setting_the_relay_and_reconciler_share() {
    let s = resolve(FileConfig::default(), Some(&file("[serve]\nevents_maxlen = 5000\n"))).unwrap();
    assert_eq!(s.serve.relay.events_maxlen, 5000);
    assert_eq!(s.reconcile_config().events_maxlen, 5000, "the reconciler judges trims by the same cap");
    let d = resolve(FileConfig::default(), None).unwrap();
    assert_eq!(d.serve.relay.events_maxlen, crate::streams::DEFAULT_EVENTS_MAXLEN);
    for bad in ["0", "999", "1000000001"] {
        let err = resolve(FileConfig::default(), Some(&file(&format!("[serve]\nevents_maxlen = {bad}\n"))))
            .unwrap_err()
            .to_string();
        assert!(err.contains("events_maxlen"), "{bad}: {err}");
    }
}

#[test]
fn flags_win_over_file_and_file_over_defaults() {
    let f = file(
        "[services]\ndatabase_url = \"postgres://file\"\n[provider]\nmodel = \"file-model\"\nrequest_timeout_ms = 1234\n[ingest]\nconcurrency = 9\ntable = \"t_file\"\n[serve]\nstream_prefix = \"p-file\"\nreplayers = 6\nmin_idle_ms = 5000\n",
    );
    let flags = FileConfig {
        provider: ProviderArgs { model: Some("flag-model".into()), ..Default::default() },
        serve: ServeArgs { replayers: Some(3), ..Default::default() },
        ..Default::default()
    };
    let s = resolve(flags, Some(&f)).unwrap();
    assert_eq!(s.database_url.as_deref(), Some("postgres://file"));
    assert_eq!(s.client.model, "flag-model");
    assert_eq!(s.client.timeout, Duration::from_millis(1234));
    assert_eq!(s.options.concurrency, 9);
    assert_eq!(s.options.batch_max_inputs, IngestOptions::default().batch_max_inputs);
    assert_eq!(s.table, "t_file");
    assert_eq!(s.stream_prefix, "p-file");
    assert_eq!(s.serve.replayers, 3, "the flag wins");
    assert_eq!(s.serve.replay.min_idle, Duration::from_secs(5));
    assert_eq!(s.serve.relay.batch, RelayConfig::default().batch, "default");
}

#[test]
fn defaults_come_from_the_library_and_are_within_bounds() {
    let s = resolve(FileConfig::default(), None).unwrap();
    assert_eq!(s.table, DEFAULT_TABLE);
    assert_eq!(s.stream_prefix, DEFAULT_STREAM_PREFIX);
    assert_eq!(s.client.base_url, DEFAULT_BASE_URL);
    assert_eq!(s.retry, RetryPolicy::default());
    assert_eq!(s.breaker, BreakerConfig::default());
    assert_eq!(s.options.dlq_schedule, DlqSchedule::default());
    assert_eq!(s.serve.replay.batch, ReplayConfig::default().batch);
    assert_eq!(s.serve.replay.min_idle, ReplayConfig::default().min_idle);
    assert_eq!(s.serve.relay.poll, RelayConfig::default().poll);
    assert_eq!(s.serve.reconcile_every, None);
    assert!(s.database_url().is_err() && s.redis_url().is_err());
    // Every default must itself pass validation when given explicitly.
    let d = IngestOptions::default();
    assert!(bounds::CONCURRENCY.contains(&d.concurrency));
    assert!(bounds::WRITERS.contains(&d.writers));
    assert!(bounds::BATCH_MAX_INPUTS.contains(&d.batch_max_inputs));
    assert!(bounds::BATCH_MAX_CHARS.contains(&d.batch_max_chars));
    assert!(bounds::MAX_INPUT_CHARS.contains(&d.max_input_chars));
    assert!(bounds::MAX_LINE_BYTES.contains(&d.max_line_bytes));
    assert!(bounds::MIN_IDLE_MS.contains(&millis(ReplayConfig::default().min_idle)));
    assert!(bounds::RELAY_POLL_MS.contains(&millis(RelayConfig::default().poll)));
    assert!(bounds::RELAY_MARKER_TTL_SECS.contains(&RelayConfig::default().marker_ttl.as_secs()));
    assert!(bounds::BREAKER_COOLDOWN_MS.contains(&millis(BreakerConfig::default().cooldown)));
    assert!(bounds::DLQ_CAP_SECS.contains(&DlqSchedule::default().cap.as_secs()));
}

/// Each config-file key with its section, from the command-line definition.
fn keys_by_section() -> Vec<(&'static str, String, clap::Arg)> {
    use clap::Command;
    let sections = [
        ("services", ServiceArgs::augment_args(Command::new("s"))),
        ("provider", ProviderArgs::augment_args(Command::new("p"))),
        ("ingest", IngestArgs::augment_args(Command::new("i"))),
        ("retry", RetryArgs::augment_args(Command::new("r"))),
        ("serve", ServeArgs::augment_args(Command::new("v"))),
        ("source", SourceArgs::augment_args(Command::new("o"))),
    ];
    let mut keys = Vec::new();
    for (section, cmd) in sections {
        for arg in cmd.get_arguments() {
            keys.push((section, arg.get_id().to_string(), arg.clone()));
        }
    }
    keys
}

/// The bound the help and the reference show is the one a value is checked against:
/// each end passes, one step beyond it is refused naming the key and that end, and no
/// help text restates a bound of its own (one place defines it).
#[test]
fn the_documented_bound_is_the_enforced_one() {
    let bounds: HashMap<&str, String> = help_bounds().into_iter().collect();
    let defaults: HashMap<&str, String> = help_defaults().into_iter().collect();
    let optional_numbers = [
        "request_dimensions",
        "max_requests_per_minute",
        "max_tokens_per_minute",
        "price_per_million_tokens",
    ];
    let mut checked = 0;
    for (section, key, arg) in keys_by_section() {
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        assert!(!help.contains("..="), "{key}: its help restates a bound: {help}");
        let numeric = defaults.get(key.as_str()).is_some_and(|d| d.parse::<f64>().is_ok())
            || optional_numbers.contains(&key.as_str());
        let Some(bound) = bounds.get(key.as_str()) else {
            assert!(!numeric, "{key}: a number without a documented bound");
            continue;
        };
        let set = |value: String| {
            // A `[source]` section names its streams.
            let streams = if section == "source" && key != "streams" { "streams = [\"s\"]\n" } else { "" };
            let text = format!("[{section}]\n{streams}{key} = {value}\n");
            resolve(FileConfig::default(), Some(&file(&text)))
        };
        let refused_naming = |r: Result<Settings, ConfigError>, end: &str| match r {
            Err(ConfigError::OutOfRange { setting, allowed, .. }) => setting == key && allowed.ends_with(end),
            Err(ConfigError::Invalid { setting, .. }) => setting == key,
            _ => false,
        };
        if key == "streams" {
            let list = |n: usize, bytes: usize| {
                let keys: Vec<String> = (0..n).map(|i| format!("\"{i:0>bytes$}\"")).collect();
                format!("[{}]", keys.join(", "))
            };
            assert_eq!(bound, "at most 64 keys of 1..=512 bytes");
            assert!(set(list(64, 512)).is_ok(), "64 keys of 512 bytes");
            assert!(refused_naming(set(list(65, 8)), ""), "65 keys");
            assert!(refused_naming(set(list(1, 513)), ""), "a key of 513 bytes");
            checked += 1;
            continue;
        }
        if let Some(chars) = bound.strip_suffix(" characters") {
            let (_, end) = chars.split_once("..=").unwrap();
            let end: usize = end.parse().unwrap();
            assert!(set(format!("\"{}\"", "x".repeat(end))).is_ok(), "{key}: {end} characters");
            assert!(refused_naming(set(format!("\"{}\"", "x".repeat(end + 1))), ""), "{key}: {end} + 1");
            checked += 1;
            continue;
        }
        let (start, end) = bound.split_once("..=").unwrap_or_else(|| panic!("{key}: {bound}"));
        let float = end.contains('.') || key == "cleanup_max_fraction" || key == "price_per_million_tokens";
        let beyond = |v: &str, step: i128| -> String {
            if float {
                (v.parse::<f64>().unwrap() + step as f64).to_string()
            } else {
                (v.parse::<i128>().unwrap() + step).to_string()
            }
        };
        let end_value = if float { format!("{:?}", end.parse::<f64>().unwrap()) } else { end.to_string() };
        assert!(set(end_value).is_ok(), "{key}: its upper end {end} is refused");
        assert!(refused_naming(set(beyond(end, 1)), end), "{key}: above {end} is not refused");
        if let Ok(lower) = start.parse::<f64>()
            && lower >= 1.0
        {
            let lower_value = if float { format!("{lower:?}") } else { start.to_string() };
            assert!(set(lower_value).is_ok(), "{key}: its lower end {start} is refused");
            assert!(refused_naming(set(beyond(start, -1)), end), "{key}: below {start} is not refused");
        }
        checked += 1;
    }
    assert!(checked >= 45, "only {checked} bounds checked");
}

#[test]
fn on_outage_defaults_to_wait_and_rejects_other_words() {
    let s = resolve(FileConfig::default(), None).unwrap();
    assert_eq!(s.options.on_outage, OnOutage::Wait);
    let flags = FileConfig {
        ingest: IngestArgs { on_outage: Some(OnOutage::Stop), ..Default::default() },
        ..Default::default()
    };
    let s = resolve(flags, Some(&file("[ingest]\non_outage = \"park\"\n"))).unwrap();
    assert_eq!(s.options.on_outage, OnOutage::Stop, "the flag wins over the file");
    let err = ConfigFile::parse(Path::new("/etc/e.toml"), "[ingest]\non_outage = \"retry\"\n").unwrap_err();
    assert!(err.to_string().contains("on_outage"), "{err}");
}

#[test]
fn on_newer_parked_defaults_to_withdraw_and_rejects_other_words() {
    let s = resolve(FileConfig::default(), None).unwrap();
    assert_eq!(s.options.on_newer_parked, OnNewerParked::Withdraw);
    let s = resolve(FileConfig::default(), Some(&file("[ingest]\non_newer_parked = \"keep\"\n"))).unwrap();
    assert_eq!(s.options.on_newer_parked, OnNewerParked::Keep);
    let flags = FileConfig {
        ingest: IngestArgs { on_newer_parked: Some(OnNewerParked::Withdraw), ..Default::default() },
        ..Default::default()
    };
    let s = resolve(flags, Some(&file("[ingest]\non_newer_parked = \"keep\"\n"))).unwrap();
    assert_eq!(s.options.on_newer_parked, OnNewerParked::Withdraw, "the flag wins over the file");
    let err =
        ConfigFile::parse(Path::new("/etc/e.toml"), "[ingest]\non_newer_parked = \"delete\"\n").unwrap_err();
    assert!(err.to_string().contains("on_newer_parked"), "{err}");
}

/// A file that sets every key: after resolution nothing may still be the default, so a
/// key the resolver forgets is caught here.
#[test]
fn every_file_key_is_used() {
    let f = file(
        r#"
[services]
database_url = "postgres://f"
redis_url = "redis://f"
redis_cluster = true
[provider]
base_url = "https://example.test/v1"
model = "m"
request_dimensions = 64
encoding_format = "float"
api_key_env = "SOME_KEY_VAR_THAT_IS_UNSET"
api_key_header = "api-key"
headers = ["X-A: 1"]
request_timeout_ms = 1000
[ingest]
table = "s.t"
batch_max_inputs = 7
batch_max_chars = 700
concurrency = 3
writers = 3
max_input_chars = 77
max_line_bytes = 7777
on_outage = "park"
on_newer_parked = "keep"
[retry]
retry_max_attempts = 7
retry_base_ms = 7
retry_cap_ms = 70
dlq_base_secs = 7
dlq_cap_secs = 70
dlq_max_replays = 7
breaker_failure_threshold = 7
breaker_cooldown_ms = 77
max_outage_secs = 7
[serve]
replayers = 7
replay_batch = 7
min_idle_ms = 777
delivery_cap = 7
grace_ms = 7
stream_prefix = "sp"
stream_shards = 7
consumer_name = "c"
relay_batch = 7
relay_poll_ms = 77
relay_marker_ttl_secs = 7777
metrics_addr = "127.0.0.1:1"
reconcile_every_secs = 7
"#,
    );
    let s = resolve(FileConfig::default(), Some(&f)).unwrap();
    assert_eq!(s.redis_url.as_deref(), Some("redis://f"));
    assert!(s.redis_cluster);
    assert_eq!(s.client.base_url, "https://example.test/v1");
    assert_eq!(s.client.request_dimensions, Some(64));
    assert_eq!(s.client.encoding, EncodingFormat::Float);
    assert_eq!(s.client.api_key_header.as_deref(), Some("api-key"));
    assert_eq!(s.client.extra_headers, vec![("X-A".to_string(), "1".to_string())]);
    assert_eq!(s.client.timeout, Duration::from_secs(1));
    assert_eq!(s.table, "s.t");
    let o = &s.options;
    assert_eq!(
        (
            o.batch_max_inputs,
            o.batch_max_chars,
            o.concurrency,
            o.writers,
            o.max_input_chars,
            o.max_line_bytes
        ),
        (7, 700, 3, 3, 77, 7777)
    );
    assert_eq!(s.retry.max_attempts, 7);
    assert_eq!((s.retry.base, s.retry.cap), (Duration::from_millis(7), Duration::from_millis(70)));
    assert_eq!(o.dlq_schedule.base, Duration::from_secs(7));
    assert_eq!(o.dlq_schedule.cap, Duration::from_secs(70));
    assert_eq!(o.dlq_schedule.max_replays, 7);
    assert_eq!(s.breaker.failure_threshold, 7);
    assert_eq!(s.breaker.cooldown, Duration::from_millis(77));
    assert_eq!(s.breaker.max_outage, Duration::from_secs(7));
    assert_eq!(o.on_outage, OnOutage::Park);
    assert_eq!(o.on_newer_parked, OnNewerParked::Keep);
    let v = &s.serve;
    assert_eq!((v.replayers, v.replay.batch, v.replay.delivery_cap, v.relay.batch), (7, 7, 7, 7));
    assert_eq!(v.replay.min_idle, Duration::from_millis(777));
    assert_eq!(v.relay.marker_ttl, Duration::from_secs(7777));
    assert_eq!(v.replay.schedule, o.dlq_schedule);
    assert_eq!(v.grace, Duration::from_millis(7));
    assert_eq!(s.stream_prefix, "sp");
    assert_eq!((s.stream_shards, s.stream_keys().shards()), (7, 7));
    assert_eq!(v.consumer_prefix.as_deref(), Some("c"));
    assert_eq!(v.relay.poll, Duration::from_millis(77));
    assert_eq!(v.metrics_addr, Some("127.0.0.1:1".parse().unwrap()));
    assert_eq!(v.reconcile_every, Some(Duration::from_secs(7)));
}

#[test]
fn out_of_range_numbers_name_the_setting_and_its_source() {
    let flags = FileConfig {
        ingest: IngestArgs { concurrency: Some(10_000_000), ..Default::default() },
        ..Default::default()
    };
    let err = resolve(flags, None).unwrap_err();
    assert!(
        matches!(&err, ConfigError::OutOfRange { setting: "concurrency", origin: Origin::Flag(f), .. } if f == "--concurrency"),
        "{err:?}"
    );
    assert!(err.to_string().contains("1..=256"), "{err}");

    let f = file("[retry]\nbreaker_cooldown_ms = 18446744073709551615\n");
    let err = resolve(FileConfig::default(), Some(&f)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "breaker_cooldown_ms = 18446744073709551615 (from /etc/e.toml [retry] breaker_cooldown_ms) is out of range: allowed 10..=60000"
    );

    // The first value past each end of a bound is refused; the ends are accepted.
    type Set = fn(&mut FileConfig, u64);
    let cases: &[(&str, Set, u64, u64)] = &[
        ("concurrency", |c, v| c.ingest.concurrency = Some(v as usize), 1, 256),
        ("writers", |c, v| c.ingest.writers = Some(v as usize), 1, 32),
        ("batch_max_inputs", |c, v| c.ingest.batch_max_inputs = Some(v as usize), 1, 2048),
        ("batch_max_chars", |c, v| c.ingest.batch_max_chars = Some(v as usize), 1, 10_000_000),
        ("max_input_chars", |c, v| c.ingest.max_input_chars = Some(v as usize), 1, 1_000_000),
        ("max_line_bytes", |c, v| c.ingest.max_line_bytes = Some(v as usize), 64, 64 << 20),
        ("max_inflight_bytes", |c, v| c.ingest.max_inflight_bytes = Some(v), 1 << 20, u32::MAX as u64),
        ("lease_secs", |c, v| c.ingest.lease_secs = Some(v), 1, 3600),
        ("request_timeout_ms", |c, v| c.provider.request_timeout_ms = Some(v), 100, 600_000),
        ("request_dimensions", |c, v| c.provider.request_dimensions = Some(v as usize), 1, 16_000),
        ("retry_max_attempts", |c, v| c.retry.retry_max_attempts = Some(v as u32), 1, 20),
        ("retry_base_ms", |c, v| c.retry.retry_base_ms = Some(v), 1, 60_000),
        ("retry_cap_ms", |c, v| c.retry.retry_cap_ms = Some(v), 500, 600_000),
        ("dlq_base_secs", |c, v| c.retry.dlq_base_secs = Some(v), 1, 86_400),
        ("dlq_cap_secs", |c, v| c.retry.dlq_cap_secs = Some(v), 60, 2_592_000),
        ("dlq_max_replays", |c, v| c.retry.dlq_max_replays = Some(v as u32), 1, 1000),
        ("breaker_failure_threshold", |c, v| c.retry.breaker_failure_threshold = Some(v as u32), 1, 10_000),
        ("breaker_cooldown_ms", |c, v| c.retry.breaker_cooldown_ms = Some(v), 10, 60_000),
        ("max_outage_secs", |c, v| c.retry.max_outage_secs = Some(v), 1, 604_800),
        ("replay_batch", |c, v| c.serve.replay_batch = Some(v as usize), 1, 2048),
        ("min_idle_ms", |c, v| c.serve.min_idle_ms = Some(v), 100, 86_400_000),
        ("delivery_cap", |c, v| c.serve.delivery_cap = Some(v as u32), 1, 1000),
        ("replay_lease_secs", |c, v| c.serve.replay_lease_secs = Some(v), 1, 86_400),
        ("replay_outstanding_max", |c, v| c.serve.replay_outstanding_max = Some(v as usize), 1, 1_000_000),
        ("relay_batch", |c, v| c.serve.relay_batch = Some(v as usize), 1, 10_000),
        ("relay_poll_ms", |c, v| c.serve.relay_poll_ms = Some(v), 10, 60_000),
        ("relay_marker_ttl_secs", |c, v| c.serve.relay_marker_ttl_secs = Some(v), 3_600, 2_592_000),
    ];
    for (name, set, lo, hi) in cases {
        for (v, ok) in [(lo - 1, false), (*lo, true), (*hi, true), (hi + 1, false)] {
            let mut c = FileConfig::default();
            set(&mut c, v);
            match resolve(c, None) {
                Ok(_) => assert!(ok, "{name} = {v} was accepted"),
                Err(e) => {
                    assert!(!ok, "{name} = {v} was refused: {e}");
                    assert!(
                        matches!(e, ConfigError::OutOfRange { setting, .. } if setting == *name),
                        "{e:?}"
                    );
                }
            }
        }
    }
    // Upper-only bounds (0 is a meaningful value).
    for (name, set, hi) in [
        ("replayers", (|c: &mut FileConfig, v: u64| c.serve.replayers = Some(v as usize)) as Set, 64),
        ("grace_ms", |c, v| c.serve.grace_ms = Some(v), 600_000),
        ("reconcile_every_secs", |c, v| c.serve.reconcile_every_secs = Some(v), 604_800),
        ("reconcile_full_every_secs", |c, v| c.serve.reconcile_full_every_secs = Some(v), 2_592_000),
        ("reconcile_deep_every_secs", |c, v| c.serve.reconcile_deep_every_secs = Some(v), 31_536_000),
    ] {
        for (v, ok) in [(0, true), (hi, true), (hi + 1, false), (u64::MAX, false)] {
            let mut c = FileConfig::default();
            set(&mut c, v);
            assert_eq!(resolve(c, None).is_ok(), ok, "{name} = {v}");
        }
    }
}

#[test]
fn debug_output_hides_service_passwords() {
    let services = ServiceArgs {
        database_url: Some("postgres://u:pg-pw-1@h/db".into()),
        redis_url: Some("redis://:redis-pw-2@h:1/".into()),
        redis_cluster: None,
    };
    let s = resolve(FileConfig { services, ..Default::default() }, None).unwrap();
    let all = format!("{s:?} {:?}", s.ingest().unwrap());
    assert!(!all.contains("pg-pw-1") && !all.contains("redis-pw-2"), "{all}");
    // Every node of a cluster's seed list too.
    let services = ServiceArgs {
        database_url: Some("postgres://h/db".into()),
        redis_url: Some("redis://:redis-pw-3@h:7001/,redis://:redis-pw-3@h:7002/".into()),
        ..Default::default()
    };
    let s = resolve(FileConfig { services, ..Default::default() }, None).unwrap();
    let all = format!("{s:?} {:?} {:?}", s.ingest().unwrap(), s.redis_client().unwrap());
    assert!(!all.contains("redis-pw-3"), "{all}");
    assert!(s.redis_cluster || s.redis_client().unwrap().is_cluster());
    assert!(all.contains("postgres://u:[redacted]@h/db") || all.contains("%5Bredacted%5D"), "{all}");
}

#[test]
fn caps_below_their_base_are_refused() {
    let flags = FileConfig {
        retry: RetryArgs { retry_base_ms: Some(1000), retry_cap_ms: Some(999), ..Default::default() },
        ..Default::default()
    };
    let err = resolve(flags, None).unwrap_err();
    assert!(matches!(err, ConfigError::OutOfRange { setting: "retry_cap_ms", .. }), "{err:?}");
    let flags = FileConfig {
        retry: RetryArgs { dlq_base_secs: Some(100), dlq_cap_secs: Some(99), ..Default::default() },
        ..Default::default()
    };
    assert!(resolve(flags, None).is_err());
}

#[test]
fn strings_are_validated() {
    let with_provider = |p: ProviderArgs| resolve(FileConfig { provider: p, ..Default::default() }, None);
    for bad in
        ["not a url", "127.0.0.1:8089/v1", "ftp://h/v1", "file:///etc/passwd", "http://", "http://h/v1?x=1"]
    {
        let err =
            with_provider(ProviderArgs { base_url: Some(bad.into()), ..Default::default() }).unwrap_err();
        assert!(matches!(err, ConfigError::Invalid { setting: "base_url", .. }), "{bad}: {err:?}");
    }
    for good in ["http://127.0.0.1:8089/v1", "https://api.openai.com/v1", "https://u:p@gw.example/openai/"] {
        with_provider(ProviderArgs { base_url: Some(good.into()), ..Default::default() }).unwrap();
    }
    assert!(with_provider(ProviderArgs { model: Some(String::new()), ..Default::default() }).is_err());
    assert!(with_provider(ProviderArgs { headers: vec!["nocolon".into()], ..Default::default() }).is_err());
    assert!(
        with_provider(ProviderArgs { headers: vec!["Bad Name: v".into()], ..Default::default() }).is_err()
    );
    assert!(
        with_provider(ProviderArgs { headers: vec!["X: a\u{7}b".into()], ..Default::default() }).is_err()
    );
    let many = (0..33).map(|i| format!("X-{i}: v")).collect();
    assert!(with_provider(ProviderArgs { headers: many, ..Default::default() }).is_err());
    assert!(
        with_provider(ProviderArgs { api_key_header: Some("a b".into()), ..Default::default() }).is_err()
    );
    assert!(with_provider(ProviderArgs { api_key_env: Some("A=B".into()), ..Default::default() }).is_err());

    let with_services = |d: &str, r: &str| {
        let services =
            ServiceArgs { database_url: Some(d.into()), redis_url: Some(r.into()), redis_cluster: None };
        resolve(FileConfig { services, ..Default::default() }, None)
    };
    assert!(with_services("postgres://u@h/db", "redis://h:1/").is_ok());
    assert!(with_services("postgresql://u@h/db", "rediss://h:1/").is_ok());
    let err = with_services("mysql://u:pw@h/db", "redis://h/").unwrap_err();
    assert!(!err.to_string().contains("pw"), "{err}");
    assert!(with_services("postgres://u@h/db", "").is_err());
    // A cluster's seed list: each URL checked, none repeated in the message, TCP only.
    let seeds = with_services("postgres://u@h/db", "redis://h:7001, redis://h:7002/").unwrap();
    assert!(seeds.redis_client().unwrap().is_cluster() && !seeds.redis_cluster);
    let err = with_services("postgres://u@h/db", "redis://:pw@h:7001,http://:pw@h:7002").unwrap_err();
    assert!(err.to_string().contains("URL 2 of the list") && !err.to_string().contains("pw"), "{err}");
    assert!(with_services("postgres://u@h/db", "redis://h:7001,unix:///tmp/r.sock").is_err());
    let many = vec!["redis://h:7001"; 65].join(",");
    assert!(with_services("postgres://u@h/db", &many).is_err());
    let one_seed = |url: &str| {
        let services = ServiceArgs {
            database_url: Some("postgres://h/db".into()),
            redis_url: Some(url.into()),
            redis_cluster: Some(true),
        };
        resolve(FileConfig { services, ..Default::default() }, None)
    };
    let s = one_seed("redis://h:7001/").unwrap();
    assert!(s.redis_cluster && s.redis_client().unwrap().is_cluster() && s.ingest().unwrap().redis_cluster);
    let err = one_seed("unix:///tmp/r.sock").unwrap_err();
    assert!(err.to_string().contains("redis_cluster"), "{err}");

    let with_table = |t: &str| {
        resolve(
            FileConfig {
                ingest: IngestArgs { table: Some(t.into()), ..Default::default() },
                ..Default::default()
            },
            None,
        )
    };
    assert!(with_table("a.b").is_ok());
    for bad in ["", "a.b.c", "a.", &"x".repeat(64)] {
        assert!(with_table(bad).is_err(), "{bad:?}");
    }
    let with_prefix = |p: &str| {
        resolve(
            FileConfig {
                serve: ServeArgs { stream_prefix: Some(p.into()), ..Default::default() },
                ..Default::default()
            },
            None,
        )
    };
    assert!(with_prefix("team-a").is_ok());
    for bad in ["", "a}b", "a b", &"p".repeat(129)] {
        assert!(with_prefix(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn origins_tell_flags_from_environment() {
    use clap::{CommandFactory, FromArgMatches, Parser};
    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        ingest: IngestArgs,
        #[command(flatten)]
        serve: ServeArgs,
    }
    let cmd = T::command();
    let m = cmd.clone().try_get_matches_from(["t", "--concurrency", "0", "--stream-prefix", "x"]).unwrap();
    let t = T::from_arg_matches(&m).unwrap();
    let origins = Origins::from_matches(&cmd, &m);
    assert_eq!(origins.of_flag("concurrency"), Origin::Flag("--concurrency".into()));
    assert_eq!(origins.of_flag("stream_prefix"), Origin::Flag("--stream-prefix".into()));
    let err = Settings::resolve(
        FileConfig { ingest: t.ingest, serve: t.serve, ..Default::default() },
        None,
        &origins,
    )
    .unwrap_err();
    assert!(err.to_string().contains("from flag --concurrency"), "{err}");
}

#[test]
fn provider_limits_are_bounded_and_sharing_needs_redis_and_a_budget() {
    let s = resolve(FileConfig::default(), None).unwrap();
    assert_eq!(s.limits, LimitConfig::default(), "off by default");
    let f = file(
        "[services]\ndatabase_url = \"postgres://d\"\nredis_url = \"redis://r\"\n[provider]\nmax_requests_per_minute = 3000\nmax_tokens_per_minute = 90000\nshared_limits = true\n",
    );
    let s = resolve(FileConfig::default(), Some(&f)).unwrap();
    assert_eq!(
        s.limits,
        LimitConfig { max_requests_per_minute: Some(3000), max_tokens_per_minute: Some(90000), shared: true }
    );
    let ingest = s.ingest().unwrap();
    assert_eq!((ingest.limits, ingest.redis_url.as_deref()), (s.limits, Some("redis://r")));
    let bad = |text: &str| resolve(FileConfig::default(), Some(&file(text))).unwrap_err().to_string();
    let err = bad("[provider]\nmax_requests_per_minute = 0\n");
    assert!(err.contains("max_requests_per_minute") && err.contains("1..=10000000"), "{err}");
    let err = bad("[provider]\nmax_tokens_per_minute = 3000000000\n");
    assert!(err.contains("max_tokens_per_minute"), "{err}");
    let err = bad("[provider]\nmax_requests_per_minute = 10\nshared_limits = true\n");
    assert!(err.contains("redis_url"), "sharing needs Redis: {err}");
    let err = bad("[services]\nredis_url = \"redis://r\"\n[provider]\nshared_limits = true\n");
    assert!(err.contains("no budget to share"), "{err}");
}
