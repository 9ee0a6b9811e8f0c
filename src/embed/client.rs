//! OpenAI-compatible `POST /v1/embeddings` client.
//!
//! Covers OpenAI, Azure-style deployments (extra headers, full URL), vLLM, TEI, Ollama and
//! LiteLLM. Asks for base64 (little-endian f32, several times cheaper to parse than JSON
//! floats) and accepts float arrays from servers that ignore the request. Every response is
//! validated (count, index permutation, dimension, finite values) before anything is stored.
//! The API key is sent as a sensitive header and never appears in an error or a log line.
//!
//! Everything the server sends is bounded before use: a server-given wait is clamped to
//! [`MAX_SERVER_WAIT`] when it is parsed, a success body is streamed and cut off at
//! [`response_cap`], an error body at 64 KiB, and any text kept from a body is redacted (the
//! key and the extra header values, case-insensitively, and their base64 echoes) *before* it
//! is cut to [`MAX_ERROR_EXCERPT`]. Redirects to another origin are refused: the key and the
//! extra headers must never reach a host they were not configured for.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;

use tokio_util::sync::CancellationToken;

use super::limit::{LimitConfig, ProviderLimiter, Ticket};
use crate::model::ErrorClass;

/// Longest error-body excerpt we keep: a real server echoed a 1 MB input in a 2 MB body.
pub const MAX_ERROR_EXCERPT: usize = 512;
/// Most bytes of an error body we ever read off the wire (and the most characters of any
/// server text we redact before cutting it to [`MAX_ERROR_EXCERPT`]).
const MAX_ERROR_BODY_READ: usize = 64 * 1024;
/// Longest wait a server may ask for (`Retry-After`, `retry-after-ms`): larger values, years
/// in the future or `1e30`, are clamped to it when parsed. The retry policy's cap then bounds
/// it further (`--retry-cap-ms`).
pub const MAX_SERVER_WAIT: Duration = Duration::from_secs(600);
/// Smallest cap on a success body, whatever the batch: room for usage, model names and
/// servers that pretty-print.
pub const MIN_RESPONSE_CAP: usize = 4 * 1024 * 1024;
/// Largest cap on a success body, whatever the batch and dimension.
pub const MAX_RESPONSE_CAP: usize = 256 * 1024 * 1024;
/// Bytes allowed per vector value in a success body: a float in JSON text takes up to ~24
/// bytes with its separator and base64 takes 5.3, so this leaves room for a vector twice the
/// expected length (which is then reported as a dimension mismatch, not as a broken body).
const RESPONSE_BYTES_PER_VALUE: usize = 48;
/// Bytes allowed per input for the envelope of its vector (`index`, `object`, quotes).
const RESPONSE_BYTES_PER_INPUT: usize = 1024;
/// Redirects followed within the configured origin.
const MAX_REDIRECTS: usize = 5;

/// The most bytes a success body for `inputs` vectors of `dimensions` values may have:
/// `inputs × (dimensions × 48 + 1024)`, at least [`MIN_RESPONSE_CAP`] and at most
/// [`MAX_RESPONSE_CAP`]. A longer body is a bad response (transient); its connection is
/// dropped as soon as the cap is passed, so memory stays bounded whatever the server sends.
pub fn response_cap(inputs: usize, dimensions: usize) -> usize {
    inputs
        .saturating_mul(
            dimensions.saturating_mul(RESPONSE_BYTES_PER_VALUE).saturating_add(RESPONSE_BYTES_PER_INPUT),
        )
        .clamp(MIN_RESPONSE_CAP, MAX_RESPONSE_CAP)
}

/// Wire format asked of the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    /// Vectors as base64 little-endian `f32`s: a few times smaller than `Float`'s JSON numbers
    /// and faster to decode.
    Base64,
    /// Vectors as JSON number arrays, for providers that do not support base64.
    Float,
}

/// How to reach the provider; built from [`crate::config::Settings`].
#[derive(Clone)]
pub struct ClientConfig {
    /// Base URL up to and excluding `/embeddings` (e.g. `http://host:8080/v1`).
    pub base_url: String,
    /// Model name sent with every request; also part of each chunk's content hash.
    pub model: String,
    /// Sent as the `dimensions` request field when set (models that support shortening).
    pub request_dimensions: Option<usize>,
    /// Wire format of the returned vectors; the client decodes either.
    pub encoding: EncodingFormat,
    /// Secret sent in `api_key_header` (or as a bearer token); `None` for providers without authentication. Never logged
    /// (`Debug` redacts it) and redacted from error excerpts.
    pub api_key: Option<String>,
    /// Header carrying the key: `None` means `Authorization: Bearer <key>`; Azure-style
    /// deployments use e.g. `api-key: <key>`.
    pub api_key_header: Option<String>,
    /// Headers added to every request (name, value), e.g. an organisation id; their values are
    /// redacted from error excerpts like the key.
    pub extra_headers: Vec<(String, String)>,
    /// Whole-request deadline; a request that exceeds it fails with [`EmbedError::Timeout`] (transient).
    pub timeout: Duration,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("base_url", &crate::redact::redact_password(&self.base_url))
            .field("model", &self.model)
            .field("request_dimensions", &self.request_dimensions)
            .field("encoding", &self.encoding)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("extra_headers", &self.extra_headers.len())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// What went wrong with one request. Carries only what classification needs: status codes,
/// error types from the body's JSON, and a short sanitised excerpt for the DLQ row.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum EmbedError {
    #[error("request timed out")]
    /// The request did not complete within [`ClientConfig::timeout`] (transient).
    Timeout,
    #[error("connect error: {0}")]
    /// No connection could be made (DNS, refused, TLS); transient, it feeds the breaker.
    Connect(String),
    /// Connection reset, closed mid-response, protocol error.
    #[error("transport error: {0}")]
    Transport(String),
    #[error("HTTP {status}{}: {excerpt}", error_type.as_deref().map(|t| format!(" ({t})")).unwrap_or_default())]
    /// The provider answered with a non-success status; the classifier decides from `status` and
    /// `error_type` whether to retry, park or stop the run.
    Status {
        /// The HTTP status code.
        status: u16,
        /// `error.type` or `error.code` from an OpenAI-style error body.
        error_type: Option<String>,
        /// The server's `Retry-After`, clamped to [`MAX_SERVER_WAIT`]; the retry waits this long
        /// (up to the retry policy's cap) instead of its own backoff.
        retry_after: Option<Duration>,
        /// Start of the body, sanitised and redacted, for the DLQ row's `last_error`.
        excerpt: String,
    },
    /// A 2xx whose body is not a valid embeddings response (truncated, garbage). The text is
    /// redacted and cut to [`MAX_ERROR_EXCERPT`]: decoder messages quote the body.
    #[error("undecodable response: {0}")]
    Decode(String),
    /// A 2xx body longer than [`response_cap`]; reading stopped there and the connection was
    /// dropped.
    #[error("response body exceeds {limit} bytes; connection dropped")]
    TooLarge {
        /// The cap that was exceeded, in bytes.
        limit: usize,
    },
    /// The server redirected to another origin (or too often). Refused so that the key and
    /// the extra headers never reach a host they were not configured for: a configuration
    /// problem, the run stops.
    #[error("redirect refused: {0}")]
    Redirect(String),
    /// A valid body whose vectors do not line up with the inputs.
    #[error("response does not match request: {0}")]
    Mismatch(String),
}

/// One validated response.
#[derive(Debug)]
pub struct EmbedResponse {
    /// One entry per input, in input order: a usable vector or the reason it is not.
    pub items: Vec<Result<Vec<f32>, VectorProblem>>,
    /// `usage.total_tokens` as the provider reported it. Some servers count characters, so
    /// the limiter only corrects its token estimate from it when the ratio is plausible
    /// (see [`super::limit::USAGE_PLAUSIBLE`]).
    pub reported_tokens: u64,
}

/// Why a single returned vector cannot be stored.
#[derive(Debug, Clone, PartialEq)]
pub struct VectorProblem {
    /// Where the vector would be parked (e.g. a wrong dimension is the input's fault).
    pub class: ErrorClass,
    /// Why, for metrics and the DLQ's `error_reason`.
    pub reason: super::Reason,
    /// What exactly was wrong (e.g. the length found), for the DLQ row's `last_error`.
    pub detail: String,
}

/// The embeddings client. Cheap to clone (shares the connection pool).
#[derive(Clone)]
pub struct EmbedClient {
    http: reqwest::Client,
    url: String,
    config: std::sync::Arc<ClientConfig>,
    redactor: Arc<Redactor>,
    /// Budget, header pacing and AIMD of every request this client (and its clones) sends.
    limiter: Arc<ProviderLimiter>,
}

#[derive(Deserialize)]
struct WireResponse {
    data: Vec<WireItem>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireItem {
    index: Option<usize>,
    embedding: WireEmbedding,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum WireEmbedding {
    Base64(String),
    Float(Vec<Option<f32>>),
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    total_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct WireErrorBody {
    error: Option<WireErrorDetail>,
}

#[derive(Deserialize)]
struct WireErrorDetail {
    #[serde(rename = "type")]
    kind: Option<serde_json::Value>,
    code: Option<serde_json::Value>,
}

impl EmbedClient {
    /// Builds the client; fails only on unusable configuration (bad header names/values).
    pub fn new(config: ClientConfig) -> Result<Self, String> {
        let mut headers = HeaderMap::new();
        if let Some(key) = &config.api_key {
            let (name, value) = match config.api_key_header.as_deref() {
                None => (reqwest::header::AUTHORIZATION, format!("Bearer {key}")),
                Some(h) if h.eq_ignore_ascii_case("authorization") => {
                    (reqwest::header::AUTHORIZATION, format!("Bearer {key}"))
                }
                Some(h) => (
                    HeaderName::from_bytes(h.as_bytes()).map_err(|_| format!("invalid header name {h:?}"))?,
                    key.clone(),
                ),
            };
            let mut v = HeaderValue::from_str(&value)
                .map_err(|_| "the API key contains characters not allowed in a header".to_string())?;
            v.set_sensitive(true);
            headers.insert(name, v);
        }
        for (name, value) in &config.extra_headers {
            let n = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("invalid header name {name:?}"))?;
            let mut v =
                HeaderValue::from_str(value).map_err(|_| format!("invalid value for header {name:?}"))?;
            v.set_sensitive(true);
            headers.insert(n, v);
        }
        let http = crate::http::client_builder()
            .default_headers(headers)
            .redirect(same_origin_redirects())
            .timeout(config.timeout)
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(64)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("cannot build HTTP client: {e}"))?;
        let url = format!("{}/embeddings", config.base_url.trim_end_matches('/'));
        let mut secrets: Vec<&str> = config.api_key.iter().map(String::as_str).collect();
        secrets.extend(config.extra_headers.iter().map(|(_, v)| v.as_str()));
        // Credentials in the URL (reqwest sends them as Basic auth) are secrets too: as
        // written, and percent-decoded (how they go on the wire).
        let userinfo = url_credentials(&config.base_url);
        secrets.extend(userinfo.iter().map(String::as_str));
        let redactor = Arc::new(Redactor::new(&secrets));
        let limiter = Arc::new(ProviderLimiter::local(LimitConfig::default()));
        Ok(EmbedClient { http, url, config: std::sync::Arc::new(config), redactor, limiter })
    }

    /// The same client with `limiter` in front of every request (see [`super::limit`]); one
    /// limiter per provider and model, shared by every clone of the client.
    pub fn with_limiter(mut self, limiter: Arc<ProviderLimiter>) -> Self {
        self.limiter = limiter;
        self
    }

    /// The limiter every request of this client goes through.
    pub fn limiter(&self) -> &Arc<ProviderLimiter> {
        &self.limiter
    }

    /// The configured model name (part of the content hash).
    pub fn model(&self) -> &str {
        &self.config.model
    }

    /// The `dimensions` request field, when one is sent.
    pub(crate) fn request_dimensions(&self) -> Option<usize> {
        self.config.request_dimensions
    }

    /// Embeds `inputs` in one request and validates the answer against `dimensions`. The
    /// request first waits for its slot in the limiter, however long that takes (see
    /// [`EmbedClient::embed_unless_cancelled`]).
    pub async fn embed(&self, inputs: &[&str], dimensions: usize) -> Result<EmbedResponse, EmbedError> {
        let tokens = self.limiter.estimate(inputs);
        let ticket = self.limiter.acquire(tokens).await;
        self.send(inputs, dimensions, tokens, ticket).await
    }

    /// Like [`EmbedClient::embed`], but a wait for the limiter's slot (the budget, the shared
    /// budget in Redis or a header pause: up to minutes) ends as soon as `cancel` fires, and
    /// then nothing is sent (`None`). A slot that is free at once is taken even after
    /// `cancel`, as the gate does: a shutdown cuts waits short, not work that needs none.
    pub async fn embed_unless_cancelled(
        &self,
        inputs: &[&str],
        dimensions: usize,
        cancel: &CancellationToken,
    ) -> Option<Result<EmbedResponse, EmbedError>> {
        let tokens = self.limiter.estimate(inputs);
        let ticket = tokio::select! {
            biased;
            ticket = self.limiter.acquire(tokens) => ticket,
            _ = cancel.cancelled() => return None,
        };
        Some(self.send(inputs, dimensions, tokens, ticket).await)
    }

    /// Sends one admitted request (`_in_flight` counts it in flight until it is answered).
    async fn send(
        &self,
        inputs: &[&str],
        dimensions: usize,
        tokens: u64,
        _in_flight: Ticket<'_>,
    ) -> Result<EmbedResponse, EmbedError> {
        let mut body = serde_json::json!({
            "model": self.config.model,
            "input": inputs,
            "encoding_format": match self.config.encoding {
                EncodingFormat::Base64 => "base64",
                EncodingFormat::Float => "float",
            },
        });
        if let Some(d) = self.config.request_dimensions {
            body["dimensions"] = d.into();
        }
        let raw_tokens = super::limit::estimate_tokens(inputs);
        let resp = self.http.post(&self.url).json(&body).send().await.map_err(|e| self.transport_error(e))?;
        let status = resp.status();
        self.limiter.observe_headers(resp.headers(), tokens);
        if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
            self.limiter.on_rate_limited().await;
        }
        if !status.is_success() {
            let now = std::time::SystemTime::now();
            let retry_after = if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
                rate_limit_wait(resp.headers(), now)
            } else {
                parse_retry_after(resp.headers(), now)
            };
            let raw = read_capped(resp, MAX_ERROR_BODY_READ).await;
            let error_type = serde_json::from_slice::<WireErrorBody>(&raw)
                .ok()
                .and_then(|b| b.error)
                .and_then(|d| value_str(d.code).or_else(|| value_str(d.kind)))
                .map(|t| self.redactor.redact(&t));
            return Err(EmbedError::Status {
                status: status.as_u16(),
                error_type,
                retry_after,
                excerpt: self.sanitize(&String::from_utf8_lossy(&raw)),
            });
        }
        let bytes = self.read_success(resp, response_cap(inputs.len(), dimensions)).await?;
        let wire: WireResponse = match serde_json::from_slice(&bytes) {
            Ok(w) => w,
            Err(first) => {
                // Python servers write NaN/Infinity as bare tokens (not JSON): read them as
                // null so that only the input they belong to fails, as `non_finite`.
                let retried = lenient_non_finite(&bytes).and_then(|b| serde_json::from_slice(&b).ok());
                match retried {
                    Some(w) => w,
                    None => {
                        let msg = format!("{first} (body of {} bytes)", bytes.len());
                        return Err(EmbedError::Decode(self.sanitize(&msg)));
                    }
                }
            }
        };
        let response = validate(wire, inputs.len(), dimensions)?;
        self.limiter.observe_usage(raw_tokens, response.reported_tokens);
        Ok(response)
    }

    /// Streams a success body, giving up (and dropping the connection) past `cap` bytes.
    async fn read_success(&self, mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, EmbedError> {
        if resp.content_length().is_some_and(|n| n > cap as u64) {
            return Err(EmbedError::TooLarge { limit: cap });
        }
        let mut buf = Vec::with_capacity(resp.content_length().map_or(64 * 1024, |n| n as usize));
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.transport_error(e))? {
            if buf.len() + chunk.len() > cap {
                return Err(EmbedError::TooLarge { limit: cap });
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    }

    fn transport_error(&self, e: reqwest::Error) -> EmbedError {
        let msg = self.sanitize(&error_chain(&e));
        if e.is_redirect() {
            EmbedError::Redirect(msg)
        } else if e.is_timeout() {
            EmbedError::Timeout
        } else if e.is_connect() {
            EmbedError::Connect(msg)
        } else {
            EmbedError::Transport(msg)
        }
    }

    /// Removes any echo of a secret, *then* truncates and strips control characters, so a
    /// secret straddling the cut can never leave a prefix behind.
    fn sanitize(&self, s: &str) -> String {
        sanitize_excerpt(&self.redactor.redact(prefix_chars(s, MAX_ERROR_BODY_READ)))
    }

    /// The same client (same HTTP pool, endpoint, credentials and limits) asking for `model`
    /// and `request_dimensions` instead: replay embeds each DLQ row with the model it was
    /// parked under, whatever the configured one is.
    pub(crate) fn with_target(&self, model: &str, request_dimensions: Option<usize>) -> EmbedClient {
        if model == self.config.model && request_dimensions == self.config.request_dimensions {
            return self.clone();
        }
        let mut config = (*self.config).clone();
        config.model = model.to_string();
        config.request_dimensions = request_dimensions;
        // Same secrets, so the redactor stays valid; the HTTP pool is shared.
        let mut client = self.clone();
        client.config = std::sync::Arc::new(config);
        client
    }
}

/// The password of `url` (and its user name, which some gateways treat as the key), both as
/// written and percent-decoded; empty when the URL has none.
fn url_credentials(url: &str) -> Vec<String> {
    let Ok(u) = reqwest::Url::parse(url) else { return Vec::new() };
    let mut out = Vec::new();
    for part in [u.username(), u.password().unwrap_or("")].into_iter().filter(|p| !p.is_empty()) {
        out.push(part.to_string());
        if let Ok(decoded) = percent_encoding::percent_decode_str(part).decode_utf8() {
            out.push(decoded.into_owned());
        }
    }
    out
}

/// The first `n` characters of `s`.
fn prefix_chars(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Follows redirects only within the configured origin (scheme, host and port), at most
/// [`MAX_REDIRECTS`] times. A redirect elsewhere is an error: reqwest would forward custom
/// credential headers (`api-key`) and the extra headers to the other host.
fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let Some(first) = attempt.previous().first() else { return attempt.follow() };
        if attempt.url().origin() != first.origin() {
            let msg = format!(
                "the provider redirected to another origin ({} -> {}); credentials are never sent there: point --base-url at the final address",
                first.origin().ascii_serialization(),
                attempt.url().origin().ascii_serialization()
            );
            attempt.error(msg)
        } else if attempt.previous().len() > MAX_REDIRECTS {
            attempt.error(format!("more than {MAX_REDIRECTS} redirects"))
        } else {
            attempt.follow()
        }
    })
}

/// Whether `c` is a Unicode format character (general category Cf: zero-width spaces and
/// joiners, bidi controls, the BOM, the soft hyphen, tags): invisible, so an echo of a secret
/// with one inserted must still count as an echo, and a stored text keeps none of them.
pub(crate) fn is_format(c: char) -> bool {
    matches!(c as u32,
        0x00AD | 0x0600..=0x0605 | 0x061C | 0x06DD | 0x070F | 0x0890..=0x0891 | 0x08E2 | 0x180E
        | 0x200B..=0x200F | 0x202A..=0x202E | 0x2060..=0x2064 | 0x2066..=0x206F | 0xFEFF
        | 0xFFF9..=0xFFFB | 0x110BD | 0x110CD | 0x13430..=0x1343F | 0x1BCA0..=0x1BCA3
        | 0x1D173..=0x1D17A | 0xE0001 | 0xE0020..=0xE007F)
}

/// Shortest secret that is redacted: shorter values would blank out ordinary words.
const MIN_SECRET_LEN: usize = 4;
/// Shortest base64 fragment of a secret that is redacted.
const MIN_BASE64_NEEDLE: usize = 4;
/// Length of the pieces of a secret that count as an echo on their own: any 8 characters of
/// the key in a row are redacted (a proxy that cut the key, or a byte inserted in it that
/// this redactor does not see through, leaves at most 7 characters on either side).
const SECRET_FRAGMENT: usize = 8;

/// Replaces every echo of the configured secrets in a server's text with `[redacted]`.
///
/// The text is matched in a normalised form: control characters, Unicode format characters
/// (zero-width spaces, bidi controls, the BOM), white space and the U+FFFD that lossy
/// decoding leaves for an invalid byte are skipped, and `%XX` escapes of ASCII are decoded,
/// so one inserted byte cannot hide an echo. In that form the redactor finds the plain value
/// ASCII case-insensitively (a proxy may lower-case a header), any [`SECRET_FRAGMENT`]
/// characters of it in a row, and its base64 encodings in the standard and URL-safe
/// alphabets at each of the three byte alignments (so `Basic` credentials and base64 dumps
/// of a header block are caught too). Each match is replaced in the original text, from its
/// first to its last character, with whatever was inserted in between.
#[derive(Debug, Default)]
pub(crate) struct Redactor {
    /// Lower-cased plain secrets.
    plain: Vec<String>,
    /// Every lower-cased [`SECRET_FRAGMENT`]-byte window of the plain secrets.
    fragments: std::collections::HashSet<Vec<u8>>,
    /// Base64 fragments determined by the secret's bytes alone (case-sensitive).
    encoded: Vec<String>,
}

/// A text in the form the redactor matches: what is left after skipping the characters an
/// echo may carry inside it, with where each of its bytes came from in the original.
struct Normalised {
    /// The kept characters (`%XX` of ASCII decoded).
    text: String,
    /// For each byte of `text`, the byte range of the original character or escape.
    origin: Vec<(usize, usize)>,
}

impl Normalised {
    fn of(original: &str) -> Normalised {
        let mut n = Normalised { text: String::with_capacity(original.len()), origin: Vec::new() };
        let bytes = original.as_bytes();
        let mut chars = original.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            let (c, end) = match c {
                '%' => match (bytes.get(i + 1), bytes.get(i + 2)) {
                    (Some(h), Some(l)) if h.is_ascii_hexdigit() && l.is_ascii_hexdigit() => {
                        let v = u8::from_str_radix(&original[i + 1..i + 3], 16).unwrap_or(0);
                        if v.is_ascii() {
                            chars.next();
                            chars.next();
                            (v as char, i + 3)
                        } else {
                            (c, i + 1)
                        }
                    }
                    _ => (c, i + 1),
                },
                _ => (c, i + c.len_utf8()),
            };
            if c.is_control() || c.is_whitespace() || is_format(c) || c == char::REPLACEMENT_CHARACTER {
                continue;
            }
            n.text.push(c);
            n.origin.extend(std::iter::repeat_n((i, end), c.len_utf8()));
        }
        n
    }

    /// The original byte range of `text[start..end]` (from its first character's start to
    /// its last one's end).
    fn span(&self, start: usize, end: usize) -> (usize, usize) {
        (self.origin[start].0, self.origin[end - 1].1)
    }
}

impl Redactor {
    /// Builds the needles for `secrets` (values shorter than 4 characters are ignored).
    pub fn new(secrets: &[&str]) -> Self {
        use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
        let mut r = Redactor::default();
        for secret in secrets.iter().filter(|s| s.len() >= MIN_SECRET_LEN) {
            let lower = secret.to_ascii_lowercase();
            r.fragments.extend(lower.as_bytes().windows(SECRET_FRAGMENT).map(<[u8]>::to_vec));
            r.plain.push(lower);
            let n = secret.len();
            for offset in 0..3usize {
                let mut bytes = vec![0u8; offset];
                bytes.extend_from_slice(secret.as_bytes());
                // Characters whose 6 bits all come from the secret: from ceil(8·offset/6)
                // to floor(8·(offset+n)/6).
                let (start, end) = ((8 * offset).div_ceil(6), (8 * (offset + n)) / 6);
                if end < start + MIN_BASE64_NEEDLE {
                    continue;
                }
                for engine in [&STANDARD_NO_PAD, &URL_SAFE_NO_PAD] {
                    let enc = engine.encode(&bytes);
                    r.encoded.push(enc[start..end].to_string());
                }
            }
        }
        r.plain.sort();
        r.plain.dedup();
        r.encoded.sort();
        r.encoded.dedup();
        r
    }

    /// `text` with every echo of a secret replaced by `[redacted]` (see [`Redactor`]).
    pub(crate) fn redact(&self, text: &str) -> String {
        if self.plain.is_empty() {
            return text.to_string();
        }
        let norm = Normalised::of(text);
        let lower = norm.text.to_ascii_lowercase();
        let mut hits: Vec<(usize, usize)> = Vec::new();
        for needle in &self.plain {
            hits.extend(lower.match_indices(needle.as_str()).map(|(i, m)| norm.span(i, i + m.len())));
        }
        if !self.fragments.is_empty() {
            for (i, w) in lower.as_bytes().windows(SECRET_FRAGMENT).enumerate() {
                if self.fragments.contains(w) {
                    hits.push(norm.span(i, i + SECRET_FRAGMENT));
                }
            }
        }
        for needle in &self.encoded {
            hits.extend(norm.text.match_indices(needle.as_str()).map(|(i, m)| norm.span(i, i + m.len())));
        }
        if hits.is_empty() {
            return text.to_string();
        }
        hits.sort_unstable();
        let mut out = String::with_capacity(text.len());
        let mut pos = 0;
        for (start, end) in hits {
            if end <= pos {
                continue; // inside the previous redaction
            }
            if start >= pos {
                out.push_str(&text[pos..start]);
                out.push_str("[redacted]");
            } // else it overlaps the previous one: extend it
            pos = end;
        }
        out.push_str(&text[pos..]);
        out
    }
}

/// Cuts an error text to [`MAX_ERROR_EXCERPT`] characters on a char boundary, replaces
/// control characters and drops format characters ([`is_format`]), so a DLQ row never
/// stores a provider's full echo of the input.
pub(crate) fn sanitize_excerpt(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(MAX_ERROR_EXCERPT + 16));
    for (n, c) in s.chars().enumerate() {
        if n >= MAX_ERROR_EXCERPT {
            out.push_str("…[truncated]");
            break;
        }
        if is_format(c) {
            continue; // invisible, and a bidi control could disguise the text around it
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out.trim().to_string()
}

/// Longest error type/code kept from a body; longer or odd ones are dropped.
const MAX_ERROR_TYPE: usize = 64;

/// An `error.type`/`error.code` value, kept only when it looks like an identifier: it is
/// shown in messages and matched by the classifier, so it must be short and plain.
fn value_str(v: Option<serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s)
            if !s.is_empty()
                && s.len() <= MAX_ERROR_TYPE
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b)) =>
        {
            Some(s)
        }
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        let room = cap.saturating_sub(buf.len());
        buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if buf.len() >= cap {
            break;
        }
    }
    buf
}

/// Reads `retry-after-ms` (milliseconds, as sent by OpenAI and Azure), else `Retry-After`,
/// else `llm_provider-retry-after` (LiteLLM's only hint on its 429s; both delta-seconds or an
/// HTTP date), clamped to [`MAX_SERVER_WAIT`]; negative or unreadable values count as
/// absent. `now` is injected so the date form is testable.
pub(crate) fn parse_retry_after(headers: &HeaderMap, now: std::time::SystemTime) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|ms| server_wait(ms / 1000.0))
    {
        return Some(ms);
    }
    [reqwest::header::RETRY_AFTER.as_str(), "llm_provider-retry-after"]
        .into_iter()
        .find_map(|name| retry_after_value(headers.get(name)?.to_str().ok()?.trim(), now))
}

/// A `Retry-After` value: delta-seconds or an HTTP date, clamped to [`MAX_SERVER_WAIT`].
fn retry_after_value(v: &str, now: std::time::SystemTime) -> Option<Duration> {
    if let Ok(secs) = v.parse::<f64>() {
        return server_wait(secs);
    }
    let when = httpdate::parse_http_date(v).ok()?;
    Some(when.duration_since(now).unwrap_or(Duration::ZERO).min(MAX_SERVER_WAIT))
}

/// The wait a 429 asks for: [`parse_retry_after`], else the `x-ratelimit-reset-*` header of
/// the limit that ran out ([`super::limit::RateHeaders::reset_wait`]). `None`: the 429 says
/// nothing usable (the gate then pauses adaptively).
pub(crate) fn rate_limit_wait(headers: &HeaderMap, now: std::time::SystemTime) -> Option<Duration> {
    parse_retry_after(headers, now).or_else(|| super::limit::RateHeaders::parse(headers).reset_wait())
}

/// A server-given number of seconds as a wait: `None` if negative or NaN, at most
/// [`MAX_SERVER_WAIT`] (clamped *before* conversion: `1e30` would overflow a `Duration`).
fn server_wait(secs: f64) -> Option<Duration> {
    if secs.is_nan() || secs < 0.0 {
        return None;
    }
    Some(Duration::from_secs_f64(secs.min(MAX_SERVER_WAIT.as_secs_f64())))
}

/// Rewrites the bare `NaN`, `Infinity`, `-Infinity` and `+Infinity` tokens that Python
/// servers emit (outside strings) as `null`; `None` when there is none.
fn lenient_non_finite(body: &[u8]) -> Option<Vec<u8>> {
    const TOKENS: [&[u8]; 4] = [b"NaN", b"Infinity", b"-Infinity", b"+Infinity"];
    let mut out = Vec::with_capacity(body.len() + 64);
    let (mut in_string, mut escaped, mut changed) = (false, false, false);
    let mut i = 0;
    while i < body.len() {
        let b = body[i];
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if b == b'"' {
            in_string = true;
        } else if let Some(t) = TOKENS.iter().find(|t| body[i..].starts_with(t)) {
            out.extend_from_slice(b"null");
            i += t.len();
            changed = true;
            continue;
        }
        out.push(b);
        i += 1;
    }
    changed.then_some(out)
}

fn validate(wire: WireResponse, expected: usize, dimensions: usize) -> Result<EmbedResponse, EmbedError> {
    if wire.data.len() != expected {
        return Err(EmbedError::Mismatch(format!("{} vectors for {expected} inputs", wire.data.len())));
    }
    let mut slots: Vec<Option<Result<Vec<f32>, VectorProblem>>> = (0..expected).map(|_| None).collect();
    for (pos, item) in wire.data.into_iter().enumerate() {
        let index = item.index.unwrap_or(pos);
        let slot = slots.get_mut(index).ok_or_else(|| {
            EmbedError::Mismatch(format!("index {index} out of range for {expected} inputs"))
        })?;
        if slot.is_some() {
            return Err(EmbedError::Mismatch(format!("index {index} returned twice")));
        }
        *slot = Some(decode_vector(item.embedding, dimensions));
    }
    let items = slots
        .into_iter()
        .map(|s| s.expect("every slot filled: counts match and indices are unique"))
        .collect();
    let reported_tokens = wire.usage.and_then(|u| u.total_tokens.or(u.prompt_tokens)).unwrap_or(0);
    Ok(EmbedResponse { items, reported_tokens })
}

fn decode_vector(e: WireEmbedding, dimensions: usize) -> Result<Vec<f32>, VectorProblem> {
    let problem = |class, reason, detail: String| VectorProblem { class, reason, detail };
    let v: Vec<f32> = match e {
        WireEmbedding::Base64(s) => {
            let bytes = base64::engine::general_purpose::STANDARD.decode(s.as_bytes()).map_err(|e| {
                problem(
                    ErrorClass::InvalidVector,
                    crate::embed::Reason::BadBase64,
                    format!("embedding is not valid base64: {e}"),
                )
            })?;
            if bytes.len() % 4 != 0 {
                return Err(problem(
                    ErrorClass::InvalidVector,
                    crate::embed::Reason::BadBase64,
                    format!("base64 embedding of {} bytes is not a whole number of f32", bytes.len()),
                ));
            }
            bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
        }
        WireEmbedding::Float(xs) => {
            let mut out = Vec::with_capacity(xs.len());
            for x in xs {
                match x {
                    Some(x) => out.push(x),
                    None => {
                        return Err(problem(
                            ErrorClass::InvalidVector,
                            crate::embed::Reason::NonFinite,
                            "embedding contains null".into(),
                        ));
                    }
                }
            }
            out
        }
    };
    if v.is_empty() {
        return Err(problem(
            ErrorClass::InvalidVector,
            crate::embed::Reason::EmptyVector,
            "empty embedding".into(),
        ));
    }
    if v.len() != dimensions {
        return Err(problem(
            ErrorClass::DimensionMismatch,
            crate::embed::Reason::DimensionMismatch,
            format!("embedding has {} dimensions, the target column has {dimensions}", v.len()),
        ));
    }
    if let Some(pos) = v.iter().position(|x| !x.is_finite()) {
        return Err(problem(
            ErrorClass::InvalidVector,
            crate::embed::Reason::NonFinite,
            format!("embedding value {pos} is {}", v[pos]),
        ));
    }
    if v.iter().all(|x| *x == 0.0) {
        return Err(problem(
            ErrorClass::InvalidVector,
            crate::embed::Reason::ZeroVector,
            "embedding is all zeros".into(),
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hm(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn retry_after_forms() {
        let now = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        assert_eq!(parse_retry_after(&hm(&[("retry-after", "7")]), now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after(&hm(&[("retry-after", "1.5")]), now), Some(Duration::from_millis(1500)));
        assert_eq!(
            parse_retry_after(&hm(&[("retry-after-ms", "250"), ("retry-after", "9")]), now),
            Some(Duration::from_millis(250)),
            "retry-after-ms is more precise and wins"
        );
        let date = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(parse_retry_after(&hm(&[("retry-after", &date)]), now), Some(Duration::from_secs(30)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(parse_retry_after(&hm(&[("retry-after", &past)]), now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after(&hm(&[("retry-after", "soon")]), now), None);
        assert_eq!(parse_retry_after(&hm(&[("retry-after", "-3")]), now), None);
        assert_eq!(parse_retry_after(&hm(&[]), now), None);
        // LiteLLM: no Retry-After on its 429, only its own header.
        assert_eq!(
            parse_retry_after(&hm(&[("llm_provider-retry-after", "60")]), now),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            parse_retry_after(&hm(&[("retry-after", "2"), ("llm_provider-retry-after", "60")]), now),
            Some(Duration::from_secs(2)),
            "the standard header wins"
        );
        assert_eq!(
            parse_retry_after(&hm(&[("llm_provider-retry-after", "1e30")]), now),
            Some(MAX_SERVER_WAIT)
        );
        // A 429 with only the reset headers: the exhausted limit's reset.
        let reset = hm(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "6m0s"),
            ("x-ratelimit-remaining-tokens", "5000"),
            ("x-ratelimit-reset-tokens", "20ms"),
        ]);
        assert_eq!(rate_limit_wait(&reset, now), Some(super::super::limit::MAX_PACING_WAIT));
        let tokens = hm(&[("x-ratelimit-remaining-tokens", "0"), ("x-ratelimit-reset-tokens", "1s")]);
        assert_eq!(rate_limit_wait(&tokens, now), Some(Duration::from_secs(1)));
        let unknown = hm(&[("x-ratelimit-reset-requests", "20ms"), ("x-ratelimit-reset-tokens", "1s")]);
        assert_eq!(
            rate_limit_wait(&unknown, now),
            Some(Duration::from_millis(20)),
            "the shortest that may clear"
        );
        assert_eq!(rate_limit_wait(&hm(&[]), now), None);
    }

    fn wire(items: Vec<(Option<usize>, WireEmbedding)>) -> WireResponse {
        WireResponse {
            data: items.into_iter().map(|(index, embedding)| WireItem { index, embedding }).collect(),
            usage: None,
        }
    }

    fn b64(v: &[f32]) -> WireEmbedding {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        WireEmbedding::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    #[test]
    fn validation_reorders_by_index_and_flags_bad_vectors() {
        let r = validate(
            wire(vec![
                (Some(2), b64(&[1.0, 2.0])),
                (Some(0), WireEmbedding::Float(vec![Some(0.5), Some(0.5)])),
                (Some(1), b64(&[f32::NAN, 1.0])),
                (Some(3), b64(&[1.0, 2.0, 3.0])),
                (Some(4), b64(&[])),
                (Some(5), b64(&[0.0, 0.0])),
            ]),
            6,
            2,
        )
        .unwrap();
        assert_eq!(r.items[0].as_ref().unwrap(), &vec![0.5, 0.5]);
        assert_eq!(r.items[2].as_ref().unwrap(), &vec![1.0, 2.0]);
        assert_eq!(r.items[1].as_ref().unwrap_err().class, ErrorClass::InvalidVector);
        assert_eq!(r.items[3].as_ref().unwrap_err().class, ErrorClass::DimensionMismatch);
        assert_eq!(r.items[4].as_ref().unwrap_err().reason, crate::embed::Reason::EmptyVector);
        assert_eq!(r.items[5].as_ref().unwrap_err().reason, crate::embed::Reason::ZeroVector);
    }

    #[test]
    fn validation_rejects_count_and_index_errors() {
        assert!(matches!(validate(wire(vec![(Some(0), b64(&[1.0]))]), 2, 1), Err(EmbedError::Mismatch(_))));
        assert!(matches!(
            validate(wire(vec![(Some(0), b64(&[1.0])), (Some(0), b64(&[1.0]))]), 2, 1),
            Err(EmbedError::Mismatch(_))
        ));
        assert!(matches!(
            validate(wire(vec![(Some(0), b64(&[1.0])), (Some(5), b64(&[1.0]))]), 2, 1),
            Err(EmbedError::Mismatch(_))
        ));
    }

    #[test]
    fn server_waits_are_clamped_not_panicking() {
        let now = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        for (h, v) in [
            ("retry-after", "1e30"),
            ("retry-after", "99999999"),
            ("retry-after", "inf"),
            ("retry-after-ms", "1e30"),
            ("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"),
        ] {
            assert_eq!(parse_retry_after(&hm(&[(h, v)]), now), Some(MAX_SERVER_WAIT), "{h}: {v}");
        }
        assert_eq!(parse_retry_after(&hm(&[("retry-after", "NaN")]), now), None);
        assert_eq!(parse_retry_after(&hm(&[("retry-after-ms", "-1")]), now), None);
    }

    #[test]
    fn response_cap_follows_the_batch_within_bounds() {
        assert_eq!(response_cap(1, 768), MIN_RESPONSE_CAP);
        assert_eq!(response_cap(512, 768), 512 * (768 * 48 + 1024));
        assert_eq!(response_cap(usize::MAX, usize::MAX), MAX_RESPONSE_CAP);
    }

    #[test]
    fn redaction_catches_case_and_base64_echoes_and_comes_before_the_cut() {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE};
        let key = "sk-AbCdEfGh0123456789";
        let r = Redactor::new(&[key, "tenant-7", "ab"]);
        for echo in [
            key.to_string(),
            key.to_lowercase(),
            key.to_uppercase(),
            STANDARD.encode(format!("Bearer {key}")),
            STANDARD.encode(format!("user:{key}")),
            URL_SAFE.encode(format!("xy{key}?")),
        ] {
            let text = format!("before {echo} after");
            let out = r.redact(&text);
            assert!(
                out.contains("[redacted]") && out.starts_with("before ") && out.ends_with(" after"),
                "{out}"
            );
            assert!(!out.to_lowercase().contains(&key[3..11].to_lowercase()), "{out}");
        }
        assert_eq!(r.redact("tenant-7 and TENANT-7"), "[redacted] and [redacted]");
        assert_eq!(r.redact("ab is too short to be a secret"), "ab is too short to be a secret");
        // A key straddling the cut leaves nothing behind.
        let text = format!("{}{key}{}", "e".repeat(MAX_ERROR_EXCERPT - 5), "z".repeat(100));
        let out = sanitize_excerpt(&r.redact(&text));
        assert!(!out.contains("sk-Ab"), "{out}");
    }

    /// Whether any 8-character window of `key` (ASCII case-insensitively) is in `text`.
    fn fragment_of(text: &str, key: &str) -> Option<String> {
        let (text, key) = (text.to_ascii_lowercase(), key.to_ascii_lowercase());
        (0..=key.len() - 8).map(|i| &key[i..i + 8]).find(|w| text.contains(*w)).map(str::to_string)
    }

    #[test]
    fn redaction_sees_through_an_inserted_byte_a_format_char_and_percent_encoding() {
        let key = "sk-AbCdEfGh0123456789";
        let r = Redactor::new(&[key]);
        let (head, tail) = key.split_at(11);
        let zwsp = '\u{200b}';
        let mut echoes: Vec<Vec<u8>> = Vec::new();
        // One byte or character inserted in the middle, at the start and near the end.
        for cut in [3, 11, 18] {
            let (a, b) = key.split_at(cut);
            for ins in [
                "\0", "\x01", "\x1b", "\n", "\r\n", "\t", "\u{7f}", "\u{200b}", "\u{200d}", "\u{feff}",
                "\u{2060}", "\u{ad}", "\u{202e}", "%2D", "%00", " ", "-", "\\",
            ] {
                echoes.push(format!("{a}{ins}{b}").into_bytes());
            }
            let mut bad_utf8 = a.as_bytes().to_vec();
            bad_utf8.push(0xff);
            bad_utf8.extend_from_slice(b.as_bytes());
            echoes.push(bad_utf8);
        }
        // Every character separated by a zero-width space; the key percent-encoded whole.
        echoes.push(key.chars().flat_map(|c| [c, zwsp]).collect::<String>().into_bytes());
        echoes.push(key.bytes().map(|b| format!("%{b:02X}")).collect::<String>().into_bytes());
        echoes.push(format!("{head}%2d{tail}").into_bytes());
        echoes.push(key.replace('-', "%2D").into_bytes());
        // Only a long piece of it (a truncating proxy, a log line cut in the middle).
        echoes.push(key.as_bytes()[..12].to_vec());
        echoes.push(key.as_bytes()[9..].to_vec());
        for echo in echoes {
            let mut body = b"{\"error\": \"invalid key: ".to_vec();
            body.extend_from_slice(&echo);
            body.extend_from_slice(b" was refused\"}");
            let shown = String::from_utf8_lossy(&echo).escape_debug().to_string();
            let stored = sanitize_excerpt(&r.redact(&String::from_utf8_lossy(&body)));
            assert!(fragment_of(&stored, key).is_none(), "{shown}: {stored}");
            assert!(!stored.to_ascii_lowercase().contains("0123"), "{shown}: {stored}");
            assert!(stored.contains("[redacted]"), "{shown}: {stored}");
            assert!(
                stored.starts_with("{\"error\": \"invalid key: ") && stored.ends_with(" was refused\"}"),
                "{shown}: {stored}"
            );
            assert!(!stored.chars().any(|c| c.is_control() || is_format(c)), "{shown}: {stored:?}");
        }
        // Text without the key is left as it was (control and format characters blanked).
        assert_eq!(sanitize_excerpt(&r.redact("sk-other 0123 key\u{200b}s")), "sk-other 0123 keys");
        assert_eq!(r.redact("100%2D is 100%"), "100%2D is 100%");
    }

    #[test]
    fn bare_non_finite_tokens_become_null_outside_strings_only() {
        let body =
            br#"{"data":[{"embedding":[NaN,1.0,-Infinity,+Infinity,Infinity]}],"model":"NaN \"Infinity\""}"#;
        let fixed = String::from_utf8(lenient_non_finite(body).unwrap()).unwrap();
        assert_eq!(fixed, r#"{"data":[{"embedding":[null,1.0,null,null,null]}],"model":"NaN \"Infinity\""}"#);
        assert!(lenient_non_finite(br#"{"a":"NaN"}"#).is_none());
    }

    #[test]
    fn excerpts_are_truncated_and_flattened() {
        let long = "x".repeat(2_000_000);
        let e = sanitize_excerpt(&long);
        assert!(e.chars().count() < MAX_ERROR_EXCERPT + 20);
        assert_eq!(sanitize_excerpt("a\nb\0c"), "a b c");
    }
}
