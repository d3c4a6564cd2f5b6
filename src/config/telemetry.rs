//! `[telemetry]`: OpenTelemetry traces, exported over OTLP/HTTP (protobuf)
//! to a collector — off unless an endpoint is set.

use serde::Deserialize;

use super::Problems;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawTelemetry {
    /// The collector's base URL (`/v1/traces` is appended).
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// Prompts and completions exported on spans (never without it).
    #[serde(default)]
    pub capture_content: bool,
    /// `service.name` of the spans.
    #[serde(default)]
    pub service_name: Option<String>,
}

/// `[telemetry]`, checked.
#[derive(Debug, Clone, Default)]
pub struct Telemetry {
    /// Where spans go: the collector's `…/v1/traces` URL (`None`: off).
    pub traces_url: Option<http::Uri>,
    pub capture_content: bool,
    pub service_name: String,
}

impl RawTelemetry {
    pub(super) fn validate(self, p: &mut Problems) -> Telemetry {
        let traces_url = self
            .otlp_endpoint
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .and_then(|e| match traces_url(e) {
                Ok(u) => Some(u),
                Err(why) => {
                    p.bad("telemetry.otlp_endpoint", format_args!("{e:?}"), why);
                    None
                }
            });
        Telemetry {
            traces_url,
            capture_content: self.capture_content,
            service_name: self
                .service_name
                .filter(|s| !s.trim().is_empty())
                .unwrap_or_else(|| "visor".to_owned()),
        }
    }
}

/// `endpoint` (a collector's base URL) with `/v1/traces` appended; a URL
/// that already ends in it is taken as it is.
fn traces_url(endpoint: &str) -> Result<http::Uri, &'static str> {
    let base = endpoint.trim_end_matches('/');
    let full = if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    };
    let uri: http::Uri = full
        .parse()
        .map_err(|_| "not a URL (e.g. \"http://127.0.0.1:4318\")")?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => Ok(uri),
        _ => Err("must be an http:// or https:// URL with a host"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_path_is_appended_once() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://otel.example/base/").unwrap(),
            "https://otel.example/base/v1/traces"
        );
        assert_eq!(
            traces_url("http://c:4318/v1/traces").unwrap(),
            "http://c:4318/v1/traces"
        );
        assert!(traces_url("127.0.0.1:4318").is_err());
        assert!(traces_url("grpc://c:4317").is_err());
    }
}
