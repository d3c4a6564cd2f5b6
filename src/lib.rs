//! visor: a transparent, streaming reverse proxy for OpenAI-compatible APIs.
//!
//! [`app::build`] is the composition root: it builds every part once from
//! the checked config and hands the proxy its narrow contexts.
//! A request enters through the tower stack in [`proxy::stack`] (request id,
//! trace span, proxy keys, router). The router answers visor's own endpoints
//! or forwards: it reads the body only where it must (the transformed
//! endpoints, or to find `model` when routing depends on it), picks the
//! upstream by the `model` glob tables in [`config`], rewrites the body when
//! the model-spec table ([`models`]) says its images cannot be seen (the pure
//! [`transform`]s; originals kept by [`artifacts`]), sends the request
//! through the pooled client in [`upstream`], and passes the response back
//! chunk by chunk through one observing body that records [`metrics`].
//! Documents a model cannot read (PDF, DOCX, PPTX, XLSX) are read to text
//! and page images by the pure [`media`] module; [`media_text`] turns them,
//! audio and images into text below the proxy (the reader, the describer
//! and transcriber calls, their cache).
//! Every answer visor gives itself to a `/v1` request, HTTP or WebSocket,
//! leaves by one edge that logs and counts it.
//! [`prompt_cache`] places cache breakpoints where the client set none and
//! explains each request's cache misses.
//! A route with `fallbacks` moves on to the next upstream within the
//! [`retries`] budget and breakers.
//! Every error visor makes itself is one [`error::VisorError`], answered in
//! the OpenAI error shape.

pub mod api;
pub mod app;
pub mod artifacts;
pub mod config;
pub mod connections;
pub mod error;
pub mod explain;
pub mod failure;
pub mod image_fit;
pub mod inspector;
pub mod limits;
pub mod log_format;
pub mod media;
pub mod media_text;
pub mod metrics;
pub mod models;
pub mod prompt_cache;
pub mod proxy;
pub mod retries;
pub mod server;
pub mod sessions;
pub mod store;
pub mod telemetry;
pub mod transform;
pub mod upstream;
