//! *Whether* to retry: maps a failed request to a [`Verdict`], keyed off status codes, error
//! types and transport error kinds — never message text. The timing lives in
//! [`super::retry`].

use std::time::Duration;

use super::client::EmbedError;
use crate::model::ErrorClass;

/// What a failed request means for the inputs it carried.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// Try again after a backoff (at least `retry_after` if the server said so).
    Retry { reason: &'static str, retry_after: Option<Duration> },
    /// The input is at fault. For a batch, split it to find the guilty input; a single input
    /// is parked at once under `class`.
    Reject { class: ErrorClass, reason: &'static str },
    /// Not the chunk's fault (bad key, no quota, unknown model, wrong URL): stop the run
    /// without parking or charging anything.
    Systemic { reason: &'static str },
}

/// Error types/codes that mean "the account is out of credit": a 429 that no wait will fix.
const QUOTA_ERROR_TYPES: &[&str] = &["insufficient_quota", "billing_hard_limit_reached", "quota_exceeded"];

/// Classifies one failed request.
pub(crate) fn classify(err: &EmbedError) -> Verdict {
    match err {
        EmbedError::Timeout => Verdict::Retry { reason: "timeout", retry_after: None },
        EmbedError::Connect(_) => Verdict::Retry { reason: "connect", retry_after: None },
        EmbedError::Transport(_) => Verdict::Retry { reason: "transport", retry_after: None },
        // A 2xx that is not JSON is a broken proxy or a truncated transfer, not the input's
        // fault and certainly not a dimension mismatch.
        EmbedError::Decode(_) => Verdict::Retry { reason: "bad_response", retry_after: None },
        // An oversized body is a broken server or proxy: the same answer as garbage.
        EmbedError::TooLarge { .. } => Verdict::Retry { reason: "bad_response", retry_after: None },
        // A redirect to another origin is configuration (wrong base URL, a login page):
        // following it would send the key elsewhere, and no input is at fault.
        EmbedError::Redirect(_) => Verdict::Systemic { reason: "redirect" },
        // Vectors that do not line up with the inputs: isolate by splitting.
        EmbedError::Mismatch(_) => {
            Verdict::Reject { class: ErrorClass::InvalidVector, reason: "response_mismatch" }
        }
        EmbedError::Status { status, error_type, retry_after, .. } => {
            classify_status(*status, error_type.as_deref(), *retry_after)
        }
    }
}

/// The status-code table of the failure taxonomy (PRODUCT.md).
pub(crate) fn classify_status(
    status: u16,
    error_type: Option<&str>,
    retry_after: Option<Duration>,
) -> Verdict {
    match status {
        429 if error_type.is_some_and(|t| QUOTA_ERROR_TYPES.contains(&t)) => {
            Verdict::Systemic { reason: "insufficient_quota" }
        }
        429 => Verdict::Retry { reason: "rate_limited", retry_after },
        408 => Verdict::Retry { reason: "http_408", retry_after },
        425 => Verdict::Retry { reason: "http_425", retry_after },
        500 => Verdict::Retry { reason: "http_500", retry_after },
        502 => Verdict::Retry { reason: "http_502", retry_after },
        503 => Verdict::Retry { reason: "http_503", retry_after },
        504 => Verdict::Retry { reason: "http_504", retry_after },
        400 => Verdict::Reject { class: ErrorClass::PermanentInput, reason: "http_400" },
        413 => Verdict::Reject { class: ErrorClass::PermanentInput, reason: "http_413" },
        422 => Verdict::Reject { class: ErrorClass::PermanentInput, reason: "http_422" },
        401 => Verdict::Systemic { reason: "unauthorized" },
        403 => Verdict::Systemic { reason: "forbidden" },
        404 => Verdict::Systemic { reason: "not_found" },
        // 405, 415, 501 and friends: the endpoint or configuration is wrong for every input.
        400..=499 | 501 | 505 => Verdict::Systemic { reason: "unexpected_status" },
        _ => Verdict::Retry { reason: "http_5xx", retry_after },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16) -> EmbedError {
        EmbedError::Status { status: code, error_type: None, retry_after: None, excerpt: String::new() }
    }

    #[test]
    fn taxonomy_table() {
        use ErrorClass::*;
        let retry = |reason| Verdict::Retry { reason, retry_after: None };
        let cases: Vec<(EmbedError, Verdict)> = vec![
            (EmbedError::Timeout, retry("timeout")),
            (EmbedError::Connect("refused".into()), retry("connect")),
            (EmbedError::Transport("connection reset".into()), retry("transport")),
            (EmbedError::Decode("expected value".into()), retry("bad_response")),
            (EmbedError::TooLarge { limit: 1 }, retry("bad_response")),
            (EmbedError::Redirect("elsewhere".into()), Verdict::Systemic { reason: "redirect" }),
            (
                EmbedError::Mismatch("3 for 4".into()),
                Verdict::Reject { class: InvalidVector, reason: "response_mismatch" },
            ),
            (status(408), retry("http_408")),
            (status(425), retry("http_425")),
            (status(429), retry("rate_limited")),
            (status(500), retry("http_500")),
            (status(502), retry("http_502")),
            (status(503), retry("http_503")),
            (status(504), retry("http_504")),
            (status(507), retry("http_5xx")),
            (status(400), Verdict::Reject { class: PermanentInput, reason: "http_400" }),
            (status(413), Verdict::Reject { class: PermanentInput, reason: "http_413" }),
            (status(422), Verdict::Reject { class: PermanentInput, reason: "http_422" }),
            (status(401), Verdict::Systemic { reason: "unauthorized" }),
            (status(403), Verdict::Systemic { reason: "forbidden" }),
            (status(404), Verdict::Systemic { reason: "not_found" }),
            (status(405), Verdict::Systemic { reason: "unexpected_status" }),
            (status(501), Verdict::Systemic { reason: "unexpected_status" }),
        ];
        for (err, want) in cases {
            assert_eq!(classify(&err), want, "{err:?}");
        }
    }

    #[test]
    fn quota_429_is_systemic_and_plain_429_keeps_retry_after() {
        let quota = EmbedError::Status {
            status: 429,
            error_type: Some("insufficient_quota".into()),
            retry_after: Some(Duration::from_secs(1)),
            excerpt: "You exceeded your current quota".into(),
        };
        assert_eq!(classify(&quota), Verdict::Systemic { reason: "insufficient_quota" });
        let limited = EmbedError::Status {
            status: 429,
            error_type: Some("rate_limit_exceeded".into()),
            retry_after: Some(Duration::from_secs(3)),
            excerpt: String::new(),
        };
        assert_eq!(
            classify(&limited),
            Verdict::Retry { reason: "rate_limited", retry_after: Some(Duration::from_secs(3)) }
        );
    }

    #[test]
    fn message_text_never_matters() {
        let e = EmbedError::Status {
            status: 400,
            error_type: None,
            retry_after: None,
            excerpt: "rate limit exceeded, please retry (timeout)".into(),
        };
        assert_eq!(classify(&e), Verdict::Reject { class: ErrorClass::PermanentInput, reason: "http_400" });
    }
}
