//! *Whether* to retry: maps a failed request to a [`Verdict`], keyed off status codes, error
//! types and transport error kinds — never message text. The timing lives in
//! [`super::retry`].

use std::time::Duration;

use super::Reason;
use super::client::EmbedError;
use crate::model::ErrorClass;

/// What a failed request means for the inputs it carried.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// Try again after a backoff (at least `retry_after` if the server said so).
    Retry { reason: Reason, retry_after: Option<Duration> },
    /// The input is at fault. For a batch, split it to find the guilty input; a single input
    /// is parked at once under `class`.
    Reject { class: ErrorClass, reason: Reason },
    /// Not the chunk's fault (bad key, no quota, unknown model, wrong URL): stop the run
    /// without parking or charging anything.
    Systemic { reason: Reason },
}

/// Error types/codes that mean "the account is out of credit": a 429 that no wait will fix.
const QUOTA_ERROR_TYPES: &[&str] = &["insufficient_quota", "billing_hard_limit_reached", "quota_exceeded"];

/// Classifies one failed request.
pub(crate) fn classify(err: &EmbedError) -> Verdict {
    match err {
        EmbedError::Timeout => Verdict::Retry { reason: Reason::Timeout, retry_after: None },
        EmbedError::Connect(_) => Verdict::Retry { reason: Reason::Connect, retry_after: None },
        EmbedError::Transport(_) => Verdict::Retry { reason: Reason::Transport, retry_after: None },
        // A 2xx that is not JSON is a broken proxy or a truncated transfer, not the input's
        // fault and certainly not a dimension mismatch.
        EmbedError::Decode(_) => Verdict::Retry { reason: Reason::BadResponse, retry_after: None },
        // An oversized body is a broken server or proxy: the same answer as garbage.
        EmbedError::TooLarge { .. } => Verdict::Retry { reason: Reason::BadResponse, retry_after: None },
        // A redirect to another origin is configuration (wrong base URL, a login page):
        // following it would send the key elsewhere, and no input is at fault.
        EmbedError::Redirect(_) => Verdict::Systemic { reason: Reason::Redirect },
        // Vectors that do not line up with the inputs: isolate by splitting.
        EmbedError::Mismatch(_) => {
            Verdict::Reject { class: ErrorClass::InvalidVector, reason: Reason::ResponseMismatch }
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
            Verdict::Systemic { reason: Reason::InsufficientQuota }
        }
        429 => Verdict::Retry { reason: Reason::RateLimited, retry_after },
        408 => Verdict::Retry { reason: Reason::Http408, retry_after },
        425 => Verdict::Retry { reason: Reason::Http425, retry_after },
        500 => Verdict::Retry { reason: Reason::Http500, retry_after },
        502 => Verdict::Retry { reason: Reason::Http502, retry_after },
        503 => Verdict::Retry { reason: Reason::Http503, retry_after },
        504 => Verdict::Retry { reason: Reason::Http504, retry_after },
        400 => Verdict::Reject { class: ErrorClass::PermanentInput, reason: Reason::Http400 },
        413 => Verdict::Reject { class: ErrorClass::PermanentInput, reason: Reason::Http413 },
        422 => Verdict::Reject { class: ErrorClass::PermanentInput, reason: Reason::Http422 },
        401 => Verdict::Systemic { reason: Reason::Unauthorized },
        403 => Verdict::Systemic { reason: Reason::Forbidden },
        404 => Verdict::Systemic { reason: Reason::NotFound },
        // 405, 415, 501 and friends: the endpoint or configuration is wrong for every input.
        400..=499 | 501 | 505 => Verdict::Systemic { reason: Reason::UnexpectedStatus },
        _ => Verdict::Retry { reason: Reason::Http5xx, retry_after },
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
            (EmbedError::Timeout, retry(Reason::Timeout)),
            (EmbedError::Connect("refused".into()), retry(Reason::Connect)),
            (EmbedError::Transport("connection reset".into()), retry(Reason::Transport)),
            (EmbedError::Decode("expected value".into()), retry(Reason::BadResponse)),
            (EmbedError::TooLarge { limit: 1 }, retry(Reason::BadResponse)),
            (EmbedError::Redirect("elsewhere".into()), Verdict::Systemic { reason: Reason::Redirect }),
            (
                EmbedError::Mismatch("3 for 4".into()),
                Verdict::Reject { class: InvalidVector, reason: Reason::ResponseMismatch },
            ),
            (status(408), retry(Reason::Http408)),
            (status(425), retry(Reason::Http425)),
            (status(429), retry(Reason::RateLimited)),
            (status(500), retry(Reason::Http500)),
            (status(502), retry(Reason::Http502)),
            (status(503), retry(Reason::Http503)),
            (status(504), retry(Reason::Http504)),
            (status(507), retry(Reason::Http5xx)),
            (status(400), Verdict::Reject { class: PermanentInput, reason: Reason::Http400 }),
            (status(413), Verdict::Reject { class: PermanentInput, reason: Reason::Http413 }),
            (status(422), Verdict::Reject { class: PermanentInput, reason: Reason::Http422 }),
            (status(401), Verdict::Systemic { reason: Reason::Unauthorized }),
            (status(403), Verdict::Systemic { reason: Reason::Forbidden }),
            (status(404), Verdict::Systemic { reason: Reason::NotFound }),
            (status(405), Verdict::Systemic { reason: Reason::UnexpectedStatus }),
            (status(501), Verdict::Systemic { reason: Reason::UnexpectedStatus }),
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
        assert_eq!(classify(&quota), Verdict::Systemic { reason: Reason::InsufficientQuota });
        let limited = EmbedError::Status {
            status: 429,
            error_type: Some("rate_limit_exceeded".into()),
            retry_after: Some(Duration::from_secs(3)),
            excerpt: String::new(),
        };
        assert_eq!(
            classify(&limited),
            Verdict::Retry { reason: Reason::RateLimited, retry_after: Some(Duration::from_secs(3)) }
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
        assert_eq!(
            classify(&e),
            Verdict::Reject { class: ErrorClass::PermanentInput, reason: Reason::Http400 }
        );
    }
}
