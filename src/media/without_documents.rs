//! A build without the `documents` feature (`--no-default-features`): no
//! PDF or Office reader is compiled in, and every document is left unread
//! with a line that says why, as a document that cannot be read is.

use std::sync::atomic::AtomicBool;

use super::{Document, Limits, ReadError};

/// Why a document was not read in this build.
pub const NOT_BUILT: &str =
    "this build of visor reads no documents (built without the `documents` feature)";

/// What a PDF read gives (see the `documents` build).
pub struct PdfRead {
    pub doc: Document,
    pub rendered: Vec<(usize, Result<Vec<u8>, ReadError>)>,
    pub work: u64,
}

/// Never reads: see [`NOT_BUILT`].
pub fn read_and_render(
    _bytes: &[u8],
    _limits: &Limits,
    _stop: &AtomicBool,
    _looks: usize,
    _dpi: f32,
) -> Result<PdfRead, ReadError> {
    Err(ReadError::new(NOT_BUILT))
}

/// Never renders: see [`NOT_BUILT`].
pub fn render_page(_bytes: &[u8], _number: usize, _dpi: f32) -> Result<Vec<u8>, ReadError> {
    Err(ReadError::new(NOT_BUILT))
}
