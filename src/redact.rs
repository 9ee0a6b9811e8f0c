//! Redaction of secrets in what the crate shows (debug output, errors, logs): a leaf every
//! layer may use, so that the provider client and the settings need not import each other.

/// `url` with its password (if any) replaced, for debug output; each URL of a
/// comma-separated list (a Redis Cluster's seed nodes) on its own.
pub(crate) fn redact_password(url: &str) -> String {
    if url.contains(',') {
        return url.split(',').map(|u| redact_one(u.trim())).collect::<Vec<_>>().join(",");
    }
    redact_one(url)
}

fn redact_one(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("[redacted]"));
            u.to_string()
        }
        Ok(_) => url.to_string(),
        Err(_) => "[unparsable URL]".to_string(),
    }
}
