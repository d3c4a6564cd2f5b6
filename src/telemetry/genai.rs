//! The OpenTelemetry GenAI semantic conventions as visor fills them: the
//! operation an endpoint performs and the provider a base URL names. Pure
//! functions.

/// `gen_ai.operation.name` for a request to `path` (the part after `/v1`).
pub fn operation(path: &str) -> &'static str {
    let path = path.trim_end_matches('/');
    if path.ends_with("/chat/completions")
        || path.ends_with("/messages")
        || path.ends_with("/responses")
    {
        "chat"
    } else if path.ends_with("/embeddings") {
        "embeddings"
    } else if path.ends_with("/completions") {
        "text_completion"
    } else if path.contains("/audio/") {
        "generate_content"
    } else {
        "other"
    }
}

/// The route a request's span is named by (`http.route`): the endpoint's
/// template for the APIs visor knows, `/v1/*` for any other path (ids and
/// a client's own paths never name spans).
pub fn route(path: &str) -> &'static str {
    const KNOWN: [&str; 12] = [
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/completions",
        "/v1/models",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/audio/speech",
        "/v1/images/generations",
        "/v1/moderations",
    ];
    let path = path.trim_end_matches('/');
    KNOWN.into_iter().find(|k| *k == path).unwrap_or("/v1/*")
}

/// The method as a span names it: a standard one, else `_OTHER`.
pub fn method(m: &http::Method) -> &'static str {
    match *m {
        http::Method::GET => "GET",
        http::Method::POST => "POST",
        http::Method::PUT => "PUT",
        http::Method::DELETE => "DELETE",
        http::Method::PATCH => "PATCH",
        http::Method::HEAD => "HEAD",
        http::Method::OPTIONS => "OPTIONS",
        _ => "_OTHER",
    }
}

/// `gen_ai.provider.name` for an upstream: the well-known value the
/// conventions list when its host names a provider, else by the API it
/// speaks (`anthropic` for the Messages kind, `openai` otherwise).
pub fn provider(host: &str, anthropic_api: bool) -> &'static str {
    let h = host.to_ascii_lowercase();
    let known: [(&str, &str); 12] = [
        ("openai.azure.com", "azure.ai.openai"),
        ("services.ai.azure.com", "azure.ai.inference"),
        ("api.openai.com", "openai"),
        ("anthropic.com", "anthropic"),
        ("bedrock", "aws.bedrock"),
        ("generativelanguage.googleapis.com", "gcp.gemini"),
        ("aiplatform.googleapis.com", "gcp.vertex_ai"),
        ("mistral.ai", "mistral_ai"),
        ("groq.com", "groq"),
        ("deepseek.com", "deepseek"),
        ("x.ai", "x_ai"),
        ("perplexity.ai", "perplexity"),
    ];
    for (part, name) in known {
        let names_it = if part.contains('.') {
            h == part || h.ends_with(&format!(".{part}"))
        } else {
            h.contains(part)
        };
        if names_it {
            return name;
        }
    }
    if anthropic_api { "anthropic" } else { "openai" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_by_endpoint() {
        assert_eq!(operation("/chat/completions"), "chat");
        assert_eq!(operation("/messages"), "chat");
        assert_eq!(operation("/responses"), "chat");
        assert_eq!(operation("/embeddings"), "embeddings");
        assert_eq!(operation("/completions"), "text_completion");
        assert_eq!(operation("/audio/transcriptions"), "generate_content");
        assert_eq!(operation("/models"), "other");
    }

    #[test]
    fn spans_are_named_by_known_routes_only() {
        assert_eq!(route("/v1/chat/completions"), "/v1/chat/completions");
        assert_eq!(route("/v1/responses/"), "/v1/responses");
        assert_eq!(route("/v1/responses/resp_123"), "/v1/*");
        assert_eq!(route("/v1/files/file-abc"), "/v1/*");
        assert_eq!(method(&http::Method::POST), "POST");
        assert_eq!(
            method(&http::Method::from_bytes(b"BREW").unwrap()),
            "_OTHER"
        );
    }

    #[test]
    fn providers_by_host_then_by_api() {
        assert_eq!(provider("api.openai.com", false), "openai");
        assert_eq!(provider("api.anthropic.com", true), "anthropic");
        assert_eq!(
            provider("my-res.openai.azure.com", false),
            "azure.ai.openai"
        );
        assert_eq!(
            provider("bedrock-runtime.us-east-1.amazonaws.com", true),
            "aws.bedrock"
        );
        assert_eq!(provider("api.groq.com", false), "groq");
        assert_eq!(provider("api.x.ai", false), "x_ai");
        // Not fooled by a host that merely contains a provider's domain.
        assert_eq!(provider("notx.ai.example", false), "openai");
        assert_eq!(provider("127.0.0.1", true), "anthropic");
        assert_eq!(provider("127.0.0.1", false), "openai");
    }
}
