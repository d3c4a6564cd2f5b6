//! The one error type at the boundary: every error visor itself answers with.
//!
//! Each variant maps, exhaustively and in one place, to an HTTP status, the
//! OpenAI error body `{"error":{"message","type","param","code"}}`, and a
//! short static label for metrics and logs. Upstream errors are not here: they
//! pass through unchanged.

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};

#[derive(Debug, thiserror::Error)]
pub enum VisorError {
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("{0}")]
    BadRequest(&'static str),
    #[error(
        "visor chooses the upstream by the body's `model` and cannot read it: {0} (send a JSON object, or multipart/form-data with a `model` field)"
    )]
    Unroutable(String),
    #[error(
        "missing or invalid proxy API key (send it as `Authorization: Bearer KEY` or `x-api-key: KEY`)"
    )]
    Unauthorized,
    #[error("no upstream is configured for model `{0}`")]
    NoRoute(String),
    #[error(
        "unknown path `{0}`: visor serves /v1/*, /healthz, /readyz, /metrics, /visor/artifacts/<sha256> and /visor/sessions/<id>"
    )]
    NotFound(String),
    #[error("method {method} is not allowed on `{path}` (it answers {allow})")]
    MethodNotAllowed {
        method: String,
        path: String,
        /// The methods it answers, as the `Allow` header lists them.
        allow: &'static str,
    },
    #[error("a WebSocket upgrade needs `Sec-WebSocket-Version: 13` (RFC 6455), not {0}")]
    WebSocketVersion(String),
    #[error("no saved image has the id `{0}`")]
    ArtifactNotFound(String),
    #[error("{0}")]
    AmbiguousArtifact(String),
    #[error(
        "the inspector is not open here: set [inspector] admin_keys and send one as `Authorization: Bearer` (it is open without a key only on a loopback address without proxy keys)"
    )]
    InspectorClosed,
    #[error("the inspector is busy: {0}; try again shortly")]
    InspectorBusy(&'static str),
    #[error("a filter of /visor/api/requests is wrong: {0}")]
    BadFilter(String),
    #[error("no kept request has the id `{0}` (the inspector keeps the newest [inspector] keep)")]
    RequestNotKept(String),
    #[error("no session has the id `{0}`")]
    SessionNotFound(String),
    #[error(
        "the session store cannot be reached ({0}); the request was not sent, so no history is lost"
    )]
    StoreUnavailable(String),
    #[error("request body is larger than the limit of {limit} bytes (server.max_body_bytes)")]
    BodyTooLarge { limit: u64 },
    #[error("the request body did not arrive within server.request_timeout_secs")]
    BodyTimeout,
    #[error("upstream `{upstream}` is unreachable: {reason}")]
    UpstreamUnreachable {
        upstream: String,
        reason: &'static str,
    },
    #[error(
        "the request's documents were not ready within server.request_timeout_secs; nothing was sent upstream"
    )]
    TransformTimeout,
    #[error("upstream `{upstream}` did not answer in time ({which})")]
    UpstreamTimeout {
        upstream: String,
        which: &'static str,
    },
    #[error("rate limit of key `{key}` reached: {detail}; try again in {retry_after_secs} s")]
    RateLimited {
        key: String,
        /// The numbers: the limit, what is left, what the request needs.
        detail: String,
        retry_after_secs: u64,
        /// `x-ratelimit-*` headers (name, value).
        headers: Vec<(&'static str, String)>,
    },
    #[error("key `{key}` may not use model `{model}` (its [[key]] models)")]
    ModelNotAllowed { key: String, model: String },
}

/// A client's mistake: `invalid_request_error` with `code`.
const fn bad(status: StatusCode, code: &'static str) -> (StatusCode, &'static str, &'static str) {
    (status, "invalid_request_error", code)
}

impl VisorError {
    /// (status, OpenAI `type`, `code`) — the exhaustive mapping.
    fn parts(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            VisorError::InvalidJson(_) => bad(StatusCode::BAD_REQUEST, "invalid_json"),
            VisorError::BadRequest(_) => bad(StatusCode::BAD_REQUEST, "invalid_request"),
            VisorError::Unroutable(_) => bad(StatusCode::BAD_REQUEST, "model_unreadable"),
            VisorError::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "invalid_api_key",
            ),
            VisorError::NoRoute(_) => bad(StatusCode::NOT_FOUND, "model_not_found"),
            VisorError::NotFound(_) => bad(StatusCode::NOT_FOUND, "unknown_url"),
            VisorError::MethodNotAllowed { .. } => {
                bad(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
            }
            VisorError::WebSocketVersion(_) => bad(
                StatusCode::UPGRADE_REQUIRED,
                "unsupported_websocket_version",
            ),
            VisorError::ArtifactNotFound(_) => bad(StatusCode::NOT_FOUND, "artifact_not_found"),
            VisorError::InspectorClosed => bad(StatusCode::FORBIDDEN, "inspector_closed"),
            VisorError::InspectorBusy(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "inspector_busy",
            ),
            VisorError::BadFilter(_) => bad(StatusCode::BAD_REQUEST, "invalid_request"),
            VisorError::RequestNotKept(_) => bad(StatusCode::NOT_FOUND, "request_not_found"),
            VisorError::AmbiguousArtifact(_) => bad(StatusCode::CONFLICT, "artifact_ambiguous"),
            VisorError::SessionNotFound(_) => bad(StatusCode::NOT_FOUND, "session_not_found"),
            VisorError::StoreUnavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "store_unavailable",
            ),
            VisorError::BodyTooLarge { .. } => bad(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            VisorError::BodyTimeout => bad(StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            VisorError::UpstreamUnreachable { .. } => (
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "upstream_unreachable",
            ),
            VisorError::UpstreamTimeout { .. } => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_error",
                "upstream_timeout",
            ),
            VisorError::TransformTimeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                "request_timeout",
            ),
            VisorError::RateLimited { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
            ),
            VisorError::ModelNotAllowed { .. } => (
                StatusCode::FORBIDDEN,
                "permission_error",
                "model_not_allowed",
            ),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.parts().0
    }

    /// Short static label for metrics and logs.
    pub fn label(&self) -> &'static str {
        self.parts().2
    }

    /// The OpenAI-shaped JSON body.
    pub fn body(&self) -> Bytes {
        let (_, kind, code) = self.parts();
        let v = serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": kind,
                "param": null,
                "code": code,
            }
        });
        Bytes::from(v.to_string())
    }

    /// The error as a Responses WebSocket-mode `error` event: the HTTP
    /// status and headers it would have had, and the OpenAI error object.
    pub fn ws_event(&self) -> String {
        let (status, kind, code) = self.parts();
        let mut headers = serde_json::Map::new();
        if let VisorError::RateLimited {
            retry_after_secs,
            headers: h,
            ..
        } = self
        {
            headers.insert("retry-after".into(), retry_after_secs.to_string().into());
            for (name, value) in h {
                headers.insert((*name).into(), value.clone().into());
            }
        }
        serde_json::json!({
            "type": "error",
            "status": status.as_u16(),
            "error": {
                "message": self.to_string(),
                "type": kind,
                "param": null,
                "code": code,
            },
            "headers": headers,
        })
        .to_string()
    }

    pub fn into_response<B: From<Bytes>>(self) -> http::Response<B> {
        let status = self.status();
        let mut resp = http::Response::new(B::from(self.body()));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let VisorError::RateLimited {
            retry_after_secs,
            headers,
            ..
        } = &self
        {
            let h = resp.headers_mut();
            h.insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_secs));
            for (name, value) in headers {
                if let Ok(v) = HeaderValue::from_str(value) {
                    h.insert(*name, v);
                }
            }
        }
        match &self {
            VisorError::MethodNotAllowed { allow, .. } => {
                resp.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static(allow));
            }
            VisorError::WebSocketVersion(_) => {
                resp.headers_mut().insert(
                    header::SEC_WEBSOCKET_VERSION,
                    HeaderValue::from_static("13"),
                );
            }
            _ => {}
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_openai_shape_and_its_status() {
        let all = [
            (VisorError::InvalidJson("eof".into()), 400),
            (VisorError::BadRequest("bad path"), 400),
            (VisorError::Unroutable("eof".into()), 400),
            (VisorError::Unauthorized, 401),
            (VisorError::NoRoute("m".into()), 404),
            (VisorError::NotFound("/x".into()), 404),
            (
                VisorError::MethodNotAllowed {
                    method: "POST".into(),
                    path: "/healthz".into(),
                    allow: "GET, HEAD",
                },
                405,
            ),
            (VisorError::WebSocketVersion("`8`".into()), 426),
            (VisorError::BodyTooLarge { limit: 1 }, 413),
            (VisorError::BodyTimeout, 408),
            (VisorError::TransformTimeout, 504),
            (VisorError::InspectorBusy("x"), 503),
            (
                VisorError::RateLimited {
                    key: "team-a".into(),
                    detail: "2 requests per minute, all used".into(),
                    retry_after_secs: 3,
                    headers: Vec::new(),
                },
                429,
            ),
            (
                VisorError::ModelNotAllowed {
                    key: "team-a".into(),
                    model: "m".into(),
                },
                403,
            ),
            (
                VisorError::UpstreamUnreachable {
                    upstream: "u".into(),
                    reason: "connection refused",
                },
                502,
            ),
            (
                VisorError::UpstreamTimeout {
                    upstream: "u".into(),
                    which: "first byte",
                },
                504,
            ),
        ];
        for (err, status) in all {
            assert_eq!(err.status().as_u16(), status, "{err:?}");
            let v: serde_json::Value = serde_json::from_slice(&err.body()).unwrap();
            let e = &v["error"];
            assert!(!e["message"].as_str().unwrap().is_empty());
            assert!(e["type"].is_string());
            assert_eq!(e["code"].as_str(), Some(err.label()));
        }
    }
}
