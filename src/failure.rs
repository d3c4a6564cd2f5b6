//! What went wrong with an upstream, as one type: the metric label it is
//! counted under (`visor_upstream_errors_total{kind}`,
//! `visor_retries_total{reason}`) and whether a fallback may be tried for
//! it, decided in one place rather than by matching strings.

use crate::upstream::SendFailure;

/// An upstream failure a request (or a WebSocket response) met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// The connection could not be made (refused, unreachable, DNS, TLS).
    Connect,
    /// The connection was not made within `connect_timeout_secs`.
    ConnectTimeout,
    /// The connection closed or reset (before the head, or mid-stream).
    Reset,
    /// No response head within `first_byte_timeout_secs`.
    FirstByteTimeout,
    /// The request's own `request_timeout_secs` passed.
    RequestTimeout,
    /// The stream went quiet for `idle_timeout_secs`.
    IdleTimeout,
    /// A 5xx answer.
    Status5xx,
    /// A 429 answer.
    Status429,
    /// The upstream said the response failed (a WebSocket `error` or
    /// `response.failed` event).
    UpstreamError,
}

impl UpstreamFailure {
    /// Its label in metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            UpstreamFailure::Connect => "connect",
            UpstreamFailure::ConnectTimeout => "connect_timeout",
            UpstreamFailure::Reset => "reset",
            UpstreamFailure::FirstByteTimeout => "first_byte_timeout",
            UpstreamFailure::RequestTimeout => "request_timeout",
            UpstreamFailure::IdleTimeout => "idle_timeout",
            UpstreamFailure::Status5xx => "status_5xx",
            UpstreamFailure::Status429 => "status_429",
            UpstreamFailure::UpstreamError => "upstream_error",
        }
    }

    /// Whether the next upstream of a fallback chain may be tried: a
    /// failure before the response head that another upstream could do
    /// better on. Not the request's own deadline (no upstream would meet
    /// it), nor anything after the head.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            UpstreamFailure::Connect
                | UpstreamFailure::ConnectTimeout
                | UpstreamFailure::Reset
                | UpstreamFailure::FirstByteTimeout
                | UpstreamFailure::Status5xx
                | UpstreamFailure::Status429
        )
    }

    /// A send failure that is the upstream's (`None`: the client's body or
    /// visor's own limit).
    pub fn of_send(f: SendFailure) -> Option<UpstreamFailure> {
        match f {
            SendFailure::Connect => Some(UpstreamFailure::Connect),
            SendFailure::ConnectTimeout => Some(UpstreamFailure::ConnectTimeout),
            SendFailure::Reset => Some(UpstreamFailure::Reset),
            SendFailure::BodyTooLarge | SendFailure::ClientBody => None,
        }
    }
}

impl std::fmt::Display for UpstreamFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_failures_before_the_head_that_another_upstream_could_avoid_are_retried() {
        use UpstreamFailure::*;
        for f in [
            Connect,
            ConnectTimeout,
            Reset,
            FirstByteTimeout,
            Status5xx,
            Status429,
        ] {
            assert!(f.retryable(), "{f}");
        }
        for f in [RequestTimeout, IdleTimeout, UpstreamError] {
            assert!(!f.retryable(), "{f}");
        }
        // Labels are the metric labels the dashboards and alerts use.
        assert_eq!(FirstByteTimeout.label(), "first_byte_timeout");
        assert_eq!(Status5xx.to_string(), "status_5xx");
        assert_eq!(
            UpstreamFailure::of_send(SendFailure::ConnectTimeout),
            Some(ConnectTimeout)
        );
        assert_eq!(UpstreamFailure::of_send(SendFailure::ClientBody), None);
    }
}
