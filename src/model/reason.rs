//! The bounded reason codes of the failure taxonomy (PRODUCT.md): one enum, so a decision
//! that depends on a reason (retry a 429 differently, suspect an input behind a 500, tell a
//! provider-wide refusal from a per-model one) is checked by the compiler instead of by
//! comparing strings, and the metrics' label set is the enum itself.
//!
//! The code is what lands in the DLQ's `error_reason` column and in the `reason` label of
//! the retry counter, so [`Reason::as_str`] is a stored format: renaming a code changes
//! what existing rows and dashboards say.

use std::fmt;

/// Declares [`Reason`] with its stored code, in one list.
macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident = $code:literal,)*) => {
        /// Why a request or an input failed.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
        }

        impl Reason {
            /// Every reason, in declaration order.
            pub const ALL: &[Reason] = &[$(Reason::$variant,)*];

            /// The stored code (DLQ `error_reason`, metric label).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$variant => $code,)*
                }
            }
        }
    };
}

reasons! {
    // Transient: retried in process, parked as `transient` when attempts run out.
    /// The request took longer than `request_timeout_ms`.
    Timeout = "timeout",
    /// No connection could be made.
    Connect = "connect",
    /// The connection broke mid-request.
    Transport = "transport",
    /// A 2xx that is not the expected JSON, or an oversized body.
    BadResponse = "bad_response",
    /// 429 without a quota error type.
    RateLimited = "rate_limited",
    /// 408 Request Timeout.
    Http408 = "http_408",
    /// 425 Too Early.
    Http425 = "http_425",
    /// 500: transient, but suspected to be the input's fault when it follows an input
    /// around (isolation, replay's deterministic-failure rule).
    Http500 = "http_500",
    /// 502 Bad Gateway.
    Http502 = "http_502",
    /// 503 Service Unavailable.
    Http503 = "http_503",
    /// 504 Gateway Timeout.
    Http504 = "http_504",
    /// Any other 5xx.
    Http5xx = "http_5xx",
    /// The circuit breaker was open when the input's turn came.
    BreakerOpen = "breaker_open",

    // The input is at fault: parked as `permanent_input` or `invalid_vector`.
    /// 400 Bad Request.
    Http400 = "http_400",
    /// 413 Payload Too Large.
    Http413 = "http_413",
    /// 422 Unprocessable Entity.
    Http422 = "http_422",
    /// The response's vectors do not line up with the inputs.
    ResponseMismatch = "response_mismatch",
    /// Empty or whitespace-only text (never sent).
    EmptyText = "empty_text",
    /// More characters than `max_input_chars` (never sent).
    TooLong = "too_long",
    /// An embedding that is not valid base64 of f32s.
    BadBase64 = "bad_base64",
    /// An embedding with a null, NaN or infinite value.
    NonFinite = "non_finite",
    /// An empty embedding.
    EmptyVector = "empty_vector",
    /// An embedding of all zeros.
    ZeroVector = "zero_vector",
    /// An embedding of another length than the target column's.
    DimensionMismatch = "dimension_mismatch",
    /// Every vector of a response unusable the same way, confirmed by the canary.
    InvalidVector = "invalid_vector",
    /// Replay saw the same 500 on the same input too often: the input is at fault.
    RepeatedHttp500 = "repeated_http_500",
    /// A source line or stream entry that could not be read into a chunk.
    InvalidRecord = "invalid_record",

    // Systemic: the run stops; nothing is parked or charged.
    /// 401.
    Unauthorized = "unauthorized",
    /// 403.
    Forbidden = "forbidden",
    /// 404: an unknown model or a wrong URL.
    NotFound = "not_found",
    /// 429 with a quota error type: no wait fixes it.
    InsufficientQuota = "insufficient_quota",
    /// A redirect to another origin.
    Redirect = "redirect",
    /// 405, 415, 501 and the like: the endpoint is wrong for every input.
    UnexpectedStatus = "unexpected_status",
    /// Every input rejected alike, confirmed by the canary.
    UniformRejection = "uniform_rejection",
}

impl Reason {
    /// Every reason a retry is counted under: the exporter shows each at zero before the
    /// first retry.
    pub const RETRIED: [Reason; 12] = [
        Reason::Timeout,
        Reason::Connect,
        Reason::Transport,
        Reason::BadResponse,
        Reason::RateLimited,
        Reason::Http408,
        Reason::Http425,
        Reason::Http500,
        Reason::Http502,
        Reason::Http503,
        Reason::Http504,
        Reason::Http5xx,
    ];

    /// Whether a refusal for this reason holds for every model and table the provider serves
    /// (the key, the account's quota, the URL) rather than only for the model a request was
    /// for (an unknown or retired model, a `dimensions` it cannot give, every input rejected
    /// alike for it).
    pub const fn is_provider_wide(self) -> bool {
        matches!(
            self,
            Reason::Unauthorized | Reason::Forbidden | Reason::InsufficientQuota | Reason::Redirect
        )
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_snake_case() {
        let mut seen = std::collections::HashSet::new();
        for r in Reason::ALL {
            let code = r.as_str();
            assert!(seen.insert(code), "{code} twice");
            assert!(
                code.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{code}"
            );
        }
    }

    #[test]
    fn stored_codes_do_not_move() {
        // Rows in the DLQ and dashboards read these strings.
        assert_eq!(Reason::Http500.as_str(), "http_500");
        assert_eq!(Reason::RateLimited.as_str(), "rate_limited");
        assert_eq!(Reason::RepeatedHttp500.as_str(), "repeated_http_500");
        assert_eq!(Reason::InvalidRecord.as_str(), "invalid_record");
    }

    #[test]
    fn only_account_and_address_refusals_are_provider_wide() {
        let wide: Vec<Reason> = Reason::ALL.iter().copied().filter(|r| r.is_provider_wide()).collect();
        assert_eq!(
            wide,
            [Reason::Unauthorized, Reason::Forbidden, Reason::InsufficientQuota, Reason::Redirect]
        );
    }
}
