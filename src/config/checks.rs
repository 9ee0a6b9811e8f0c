//! Checks of the values that are not numbers: URLs, names, headers, table names.

use super::*;

pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A service URL of one of `schemes`. The message never repeats the URL (it may hold a
/// password).
pub(super) fn check_scheme(url: &str, schemes: &[&str]) -> Result<(), String> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    match scheme {
        Some(s) if schemes.contains(&s.as_str()) => Ok(()),
        _ => Err(format!("not a URL of scheme {}", schemes.join(", "))),
    }
}

/// A Redis URL, or several comma-separated ones (a cluster's seed nodes, at most
/// [`crate::streams::conn::MAX_SEED_NODES`], TCP only). The message never repeats a URL (it
/// may hold a password).
pub(super) fn check_redis_urls(urls: &str) -> Result<(), String> {
    let nodes = crate::streams::conn::split_urls(urls);
    let max = crate::streams::conn::MAX_SEED_NODES;
    if nodes.is_empty() {
        return Err("no URL".into());
    }
    if nodes.len() > max {
        return Err(format!("{} URLs; a cluster's seed list takes at most {max}", nodes.len()));
    }
    for (i, u) in nodes.iter().enumerate() {
        let which = if nodes.len() > 1 { format!("URL {} of the list: ", i + 1) } else { String::new() };
        check_scheme(u, &["redis", "rediss", "redis+unix", "unix"]).map_err(|p| format!("{which}{p}"))?;
        if nodes.len() > 1 && is_unix_socket(u) {
            return Err(format!("{which}a Redis Cluster is reached over TCP, not a unix socket"));
        }
    }
    Ok(())
}

pub(super) fn is_unix_socket(url: &str) -> bool {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    matches!(scheme.as_deref(), Some("redis+unix" | "unix"))
}

pub(super) fn no_control(s: &str) -> Result<(), String> {
    if s.chars().any(char::is_control) { Err("must not contain control characters".into()) } else { Ok(()) }
}

pub(super) fn check_len(s: &str, range: RangeInclusive<usize>) -> Result<(), String> {
    let n = s.chars().count();
    if range.contains(&n) {
        Ok(())
    } else {
        Err(format!("{n} characters; allowed {}..={}", range.start(), range.end()))
    }
}

/// An absolute http(s) URL with a host: anything else would fail every request (and park the
/// corpus as transient) instead of failing the command.
pub(super) fn check_base_url(s: &str) -> Result<(), String> {
    if s.len() > bounds::URL_CHARS {
        return Err(format!("longer than {} characters", bounds::URL_CHARS));
    }
    let url =
        reqwest::Url::parse(s).map_err(|e| format!("not a URL ({e}); e.g. https://api.openai.com/v1"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("scheme {:?} is not http or https", url.scheme()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("has no host".into());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("must not have a query or fragment (`/embeddings` is appended to it)".into());
    }
    Ok(())
}

pub(super) fn check_env_name(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 256 || s.contains(['=', '\0']) || s.chars().any(char::is_whitespace) {
        Err("not a valid environment variable name".into())
    } else {
        Ok(())
    }
}

pub(super) fn check_header_name(s: &str) -> Result<(), String> {
    reqwest::header::HeaderName::from_bytes(s.as_bytes())
        .map(drop)
        .map_err(|_| format!("{s:?} is not a valid header name"))
}

pub(super) fn check_table(s: &str) -> Result<(), String> {
    crate::store::quote_table_name(s)?;
    if s.split('.').any(|p| p.len() > bounds::IDENTIFIER_BYTES) {
        return Err(format!("each part of a table name has at most {} bytes", bounds::IDENTIFIER_BYTES));
    }
    no_control(s)
}

/// Checks a stream prefix against its bounds (length, no control characters, no braces or
/// whitespace: it is wrapped in a Redis hash tag), as every setting of it is checked.
pub fn check_stream_prefix(s: &str) -> Result<(), String> {
    check_len(s, bounds::NAME_CHARS)?;
    no_control(s)?;
    if s.contains(['{', '}']) || s.chars().any(char::is_whitespace) {
        return Err("must not contain braces or whitespace (it is wrapped in a hash tag)".into());
    }
    Ok(())
}
