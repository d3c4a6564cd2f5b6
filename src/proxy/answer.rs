//! Answers visor gives itself, before any upstream was chosen.

use http::Response;

use super::AppState;
use super::body::ProxyBody;
use crate::error::VisorError;
use crate::metrics::NO_UPSTREAM;

/// An error answered before any upstream was chosen: logged, counted in
/// `visor_requests_total{upstream=""}`, in the OpenAI error shape.
pub fn refuse(state: &AppState, e: VisorError) -> Response<ProxyBody> {
    tracing::info!(error = e.label(), status = e.status().as_u16(), "refused");
    state
        .metrics
        .requests
        .with_label_values(&[NO_UPSTREAM, "", e.status().as_str()])
        .inc();
    e.into_response()
}
