//! Documents a model cannot read, turned into what it can: the text of each
//! page (slide, sheet), which pages need a look by a vision model, the images
//! embedded in them, and PDF pages rendered to PNG.
//!
//! Pure: no async and no I/O. Everything here runs on untrusted bytes, so no
//! input may panic or hang: every parser call is wrapped in
//! [`std::panic::catch_unwind`] (a panic becomes "damaged: …"), pages beyond
//! [`Limits::max_pages`] and text beyond [`Limits::max_text_bytes`] are not
//! read, and a zip that unpacks beyond [`Limits::max_unpacked_bytes`] is
//! refused.
//!
//! - PDF ([`pdf`]): hayro's interpreter (pure Rust) walks each page's content
//!   with a device that collects glyphs into lines and counts images and
//!   vector paths; hayro's rasterizer renders a page ([`render_page`]).
//! - DOCX, PPTX, XLSX ([`office`]): the zip's XML parts read with quick-xml.
//!   A DOCX has no pages in its XML: its "pages" are split at the page breaks
//!   the file records (hard breaks, and the breaks Word noted when it last laid
//!   the document out); a file without any is one page.

#[cfg(feature = "documents")]
use std::panic::{AssertUnwindSafe, catch_unwind};

#[cfg(feature = "documents")]
pub mod office;
#[cfg(feature = "documents")]
pub mod pdf;
#[cfg(feature = "documents")]
mod pdf_guard;
#[cfg(not(feature = "documents"))]
mod without_documents;

#[cfg(feature = "documents")]
pub use pdf::{PdfRead, read_and_render, render_page};
#[cfg(feature = "documents")]
pub use pdf_guard::MAX_IMAGE_PIXELS;
#[cfg(not(feature = "documents"))]
pub use without_documents::{PdfRead, read_and_render, render_page};

/// Why a document is not read in a build without the `documents` feature.
pub const NOT_BUILT: &str =
    "this build of visor reads no documents (built without the `documents` feature)";

/// The version of what [`read`] makes of a document: bump it whenever the
/// text extracted from a document may change, so that texts kept under an
/// older version are not served again (3: a text page with a picture holds
/// a figure, so it is described).
pub const READER_VERSION: u32 = 3;

/// The kinds of document read here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DocKind {
    /// Portable Document Format.
    Pdf,
    /// Word (Office Open XML).
    Docx,
    /// PowerPoint (Office Open XML).
    Pptx,
    /// Excel (Office Open XML).
    Xlsx,
}

const PDF_TYPE: &str = "application/pdf";
const DOCX_TYPE: &str = "application/vnd.openxmlformats-officedocument.wordprocessingml.document";
const PPTX_TYPE: &str = "application/vnd.openxmlformats-officedocument.presentationml.presentation";
const XLSX_TYPE: &str = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet";

impl DocKind {
    /// From a declared media type (e.g. `application/pdf`), else the file
    /// name's extension, else the bytes' magic (`%PDF-`; a zip holding
    /// `word/`, `ppt/` or `xl/`). A declared type that names something else
    /// (an image, `text/plain`) is believed: `None`. A generic one
    /// (`application/octet-stream`, `application/zip`, absent) falls through
    /// to the name and then the bytes. `None`: not a document read here.
    pub fn detect(media_type: Option<&str>, filename: Option<&str>, bytes: &[u8]) -> Option<Self> {
        if let Some(declared) = media_type {
            let essence = declared
                .split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase();
            match essence.as_str() {
                PDF_TYPE | "application/x-pdf" => return Some(Self::Pdf),
                DOCX_TYPE => return Some(Self::Docx),
                PPTX_TYPE => return Some(Self::Pptx),
                XLSX_TYPE => return Some(Self::Xlsx),
                e if e.starts_with(
                    "application/vnd.openxmlformats-officedocument.wordprocessingml.",
                ) || e.starts_with("application/vnd.ms-word.") =>
                {
                    return Some(Self::Docx);
                }
                e if e.starts_with(
                    "application/vnd.openxmlformats-officedocument.presentationml.",
                ) || e.starts_with("application/vnd.ms-powerpoint.") =>
                {
                    return Some(Self::Pptx);
                }
                e if e.starts_with(
                    "application/vnd.openxmlformats-officedocument.spreadsheetml.",
                ) || e.starts_with("application/vnd.ms-excel.") =>
                {
                    return Some(Self::Xlsx);
                }
                ""
                | "application/octet-stream"
                | "application/zip"
                | "binary/octet-stream"
                | "application/x-zip-compressed" => {}
                _ => return None,
            }
        }
        if let Some(name) = filename
            && let Some((_, ext)) = name.rsplit_once('.')
        {
            match ext.to_ascii_lowercase().as_str() {
                "pdf" => return Some(Self::Pdf),
                // Documents, templates, macro-enabled files and slide
                // shows are one format each.
                "docx" | "docm" | "dotx" | "dotm" => return Some(Self::Docx),
                "pptx" | "pptm" | "ppsx" | "ppsm" | "potx" | "potm" => return Some(Self::Pptx),
                "xlsx" | "xlsm" | "xltx" | "xltm" => return Some(Self::Xlsx),
                _ => {}
            }
        }
        Self::sniff(bytes)
    }

    /// The kind the bytes themselves say: `%PDF-` (within the first KiB, as
    /// readers allow), or a zip whose entries' names start `word/`, `ppt/`,
    /// `xl/` (read from the local headers; the central directory is not
    /// needed).
    fn sniff(bytes: &[u8]) -> Option<Self> {
        let head = bytes.get(..bytes.len().min(1024)).unwrap_or_default();
        if memchr::memmem::find(head, b"%PDF-").is_some() {
            return Some(Self::Pdf);
        }
        if !bytes.starts_with(b"PK\x03\x04") {
            return None;
        }
        // Walk the local file headers: name length at 26, extra at 28, name at 30.
        let mut at = 0usize;
        for _ in 0..64 {
            let header = bytes.get(at..at.checked_add(30)?)?;
            if !header.starts_with(b"PK\x03\x04") {
                return None;
            }
            let word = |i: usize| u16::from_le_bytes([header[i], header[i + 1]]) as usize;
            let flags = word(6);
            let compressed = u32::from_le_bytes([header[18], header[19], header[20], header[21]]);
            let name_len = word(26);
            let extra_len = word(28);
            let name = bytes.get(at + 30..at + 30 + name_len)?;
            for (prefix, kind) in [
                (&b"word/"[..], Self::Docx),
                (b"ppt/", Self::Pptx),
                (b"xl/", Self::Xlsx),
            ] {
                if name.starts_with(prefix) {
                    return Some(kind);
                }
            }
            if flags & 0x08 != 0 {
                // Sizes follow the data: the next header can't be found cheaply.
                return None;
            }
            at = at
                .checked_add(30 + name_len + extra_len)?
                .checked_add(compressed as usize)?;
        }
        None
    }

    /// The media type of this kind.
    pub fn media_type(self) -> &'static str {
        match self {
            Self::Pdf => PDF_TYPE,
            Self::Docx => DOCX_TYPE,
            Self::Pptx => PPTX_TYPE,
            Self::Xlsx => XLSX_TYPE,
        }
    }

    /// A short name a person reads: "PDF", "DOCX", "PPTX", "XLSX".
    pub fn label(self) -> &'static str {
        match self {
            Self::Pdf => "PDF",
            Self::Docx => "DOCX",
            Self::Pptx => "PPTX",
            Self::Xlsx => "XLSX",
        }
    }

    /// What one [`Page`] is: "page" (PDF, and DOCX split at its recorded page
    /// breaks), "slide", "sheet".
    pub fn unit(self) -> &'static str {
        match self {
            Self::Pdf | Self::Docx => "page",
            Self::Pptx => "slide",
            Self::Xlsx => "sheet",
        }
    }
}

/// A document's text and images, page by page.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Document {
    /// What was read.
    pub kind: DocKind,
    /// The pages read, in order.
    pub pages: Vec<Page>,
    /// Pages beyond [`Limits::max_pages`] were not read, or the text was cut
    /// at [`Limits::max_text_bytes`], or reading stopped early (`stopped`).
    pub truncated: bool,
    /// Why the pages after the last one read were not read, when it was not
    /// the page limit: "over the work budget", "over the time budget", …
    pub stopped: Option<String>,
}

/// One page, slide or sheet.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Page {
    /// 1-based.
    pub number: usize,
    /// In reading order; tables as rows with cells joined by " | ", sheets as
    /// rows. Cleaned: no control characters but `\n` and `\t`, no run of
    /// blank lines.
    pub text: String,
    /// PDF: the page draws images or substantial vector graphics, or has no
    /// text at all (a scan): a vision model should look at its rendering.
    /// Office: the page embeds images (they are in [`Page::images`]).
    pub needs_look: bool,
    /// Office: the images embedded on this page or slide, in order. PDF:
    /// empty (render the page instead).
    pub images: Vec<Embedded>,
}

/// An image embedded in an Office document.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Embedded {
    /// The part's file name, e.g. `image1.png`.
    pub name: String,
    /// From the file name's extension, e.g. `image/png`.
    pub media_type: String,
    /// The image's bytes as stored.
    #[serde(with = "base64_bytes")]
    pub bytes: Vec<u8>,
}

/// Bounds on the work done for one document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Pages (slides, sheets) read; the rest set [`Document::truncated`].
    pub max_pages: usize,
    /// Text kept over all pages; the rest is cut.
    pub max_text_bytes: usize,
    /// Characters of text kept over all pages (`documents.max_document_chars`):
    /// reading stops once they are held, the rest is not read (an XLSX that
    /// repeats one long shared string in every cell is not unpacked past
    /// it).
    pub max_text_chars: usize,
    /// Bytes inflated from a zip (Office) over all its parts read.
    pub max_unpacked_bytes: usize,
    /// PDF: content-stream bytes interpreted over all pages, a stream
    /// counted again for each page that draws it; the pages after are not
    /// read.
    pub max_content_bytes: usize,
    /// PDF: interpreter work over the document (drawing calls, path
    /// elements and glyphs, in reading and in rendering); the pages after
    /// are not read, or not rendered.
    pub max_work: u64,
    /// PDF: wall-clock time for reading and rendering one document, checked
    /// between pages and inside the interpreter.
    pub deadline: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_pages: 2000,
            max_text_bytes: 4 << 20,
            max_text_chars: usize::MAX,
            max_unpacked_bytes: 256 << 20,
            max_content_bytes: 64 << 20,
            max_work: 20_000_000,
            deadline: std::time::Duration::from_secs(5),
        }
    }
}

/// Why a document could not be read, as a person reads it in a placeholder:
/// "encrypted", "not a PDF", "damaged: …", "too large when unpacked".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ReadError(String);

impl ReadError {
    pub(crate) fn new(reason: impl Into<String>) -> Self {
        Self(reason.into())
    }

    #[cfg(feature = "documents")]
    pub(crate) fn damaged(what: impl std::fmt::Display) -> Self {
        Self(format!("damaged: {what}"))
    }

    #[cfg(feature = "documents")]
    pub(crate) fn encrypted() -> Self {
        Self::new("encrypted")
    }

    #[cfg(feature = "documents")]
    pub(crate) fn too_large() -> Self {
        Self::new("too large when unpacked")
    }

    /// The reason, e.g. "encrypted".
    pub fn reason(&self) -> &str {
        &self.0
    }
}

/// Read a document's pages. Never panics (a parser's panic is caught and
/// becomes "damaged: …").
#[cfg(feature = "documents")]
pub fn read(kind: DocKind, bytes: &[u8], limits: &Limits) -> Result<Document, ReadError> {
    guarded(|| match kind {
        DocKind::Pdf => pdf::read(bytes, limits),
        DocKind::Docx => office::read_docx(bytes, limits),
        DocKind::Pptx => office::read_pptx(bytes, limits),
        DocKind::Xlsx => office::read_xlsx(bytes, limits),
    })
}

/// Read a document's pages: never, in a build without the `documents`
/// feature (see [`NOT_BUILT`]).
#[cfg(not(feature = "documents"))]
pub fn read(_kind: DocKind, _bytes: &[u8], _limits: &Limits) -> Result<Document, ReadError> {
    Err(ReadError::new(without_documents::NOT_BUILT))
}

/// Run `f`, turning a panic into "damaged: …".
#[cfg(feature = "documents")]
pub(crate) fn guarded<T>(f: impl FnOnce() -> Result<T, ReadError>) -> Result<T, ReadError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "the parser failed".to_owned());
            let what: String = what.chars().take(120).collect();
            Err(ReadError::damaged(format!("parser panicked ({what})")))
        }
    }
}

/// Why reading stopped when [`Limits::max_text_chars`] were held.
pub const TEXT_BUDGET: &str = "over the text budget";

/// Collects pages under the limits: cleans each page's text, cuts the text
/// at the byte budget, and notes truncation.
#[cfg(feature = "documents")]
pub(crate) struct PageSink {
    pages: Vec<Page>,
    limits: Limits,
    text_bytes: usize,
    text_chars: usize,
    truncated: bool,
    stopped: Option<String>,
}

#[cfg(feature = "documents")]
impl PageSink {
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            pages: Vec::new(),
            limits: *limits,
            text_bytes: 0,
            text_chars: 0,
            truncated: false,
            stopped: None,
        }
    }

    /// Whether another page may be read; false (and truncated) once the page
    /// or text budget is spent.
    pub(crate) fn wants_more(&mut self) -> bool {
        if self.pages.len() >= self.limits.max_pages
            || self.text_bytes >= self.limits.max_text_bytes
        {
            self.truncated = true;
            return false;
        }
        if self.text_chars >= self.limits.max_text_chars {
            self.cut_at_chars();
            return false;
        }
        true
    }

    /// Characters of text the next pages may still hold.
    pub(crate) fn room_chars(&self) -> usize {
        self.limits.max_text_chars.saturating_sub(self.text_chars)
    }

    /// The text budget in characters is spent: what follows is not read.
    pub(crate) fn cut_at_chars(&mut self) {
        self.truncated = true;
        if self.stopped.is_none() {
            self.stopped = Some(TEXT_BUDGET.to_owned());
        }
    }

    /// Add the next page (numbered in order).
    pub(crate) fn push(&mut self, raw_text: &str, needs_look: bool, images: Vec<Embedded>) {
        let mut text = clean_text(raw_text);
        let room = self.limits.max_text_bytes.saturating_sub(self.text_bytes);
        if text.len() > room {
            let mut cut = room;
            while cut > 0 && !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            self.truncated = true;
        }
        let room = self.room_chars();
        let chars = match text.char_indices().nth(room) {
            Some((at, _)) => {
                text.truncate(at);
                self.cut_at_chars();
                room
            }
            None => text.chars().count(),
        };
        self.text_chars += chars;
        self.text_bytes += text.len();
        self.pages.push(Page {
            number: self.pages.len() + 1,
            text,
            needs_look,
            images,
        });
    }

    pub(crate) fn mark_truncated(&mut self) {
        self.truncated = true;
    }

    /// No more pages are read, because `why`.
    pub(crate) fn stop(&mut self, why: &str) {
        self.truncated = true;
        self.stopped = Some(why.to_owned());
    }

    pub(crate) fn finish(self, kind: DocKind) -> Document {
        Document {
            kind,
            pages: self.pages,
            truncated: self.truncated,
            stopped: self.stopped,
        }
    }
}

/// No control characters but `\n` and `\t` (`\r\n` and `\r` become `\n`;
/// other controls, and U+FFFE/U+FFFF, are dropped), no trailing spaces on a
/// line, no leading or trailing blank lines, and at most one blank line in a
/// row.
pub fn clean_text(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut blank_run = 0usize;
    let normalized = raw.replace("\r\n", "\n");
    for line in normalized.split(['\n', '\r', '\u{b}', '\u{c}', '\u{2028}', '\u{2029}']) {
        let kept: String = line
            .chars()
            .filter(|&c| c == '\t' || !(c.is_control() || c == '\u{fffe}' || c == '\u{ffff}'))
            .collect();
        let kept = kept.trim_end();
        if kept.trim().is_empty() {
            blank_run += 1;
            continue;
        }
        if !out.is_empty() {
            out.push('\n');
            if blank_run > 0 {
                out.push('\n');
            }
        }
        blank_run = 0;
        out.push_str(kept);
    }
    out
}

/// The media type of an image part from its file name's extension.
#[cfg(feature = "documents")]
pub(crate) fn image_media_type(name: &str) -> String {
    let ext = name
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" | "jpe" => "image/jpeg",
        "gif" => "image/gif",
        "bmp" | "dib" => "image/bmp",
        "tif" | "tiff" => "image/tiff",
        "webp" => "image/webp",
        "svg" => "image/svg+xml",
        "emf" => "image/emf",
        "wmf" => "image/wmf",
        _ => "application/octet-stream",
    }
    .to_owned()
}

/// Bytes as a base64 string in JSON (a document read in another process
/// comes back this way).
pub mod base64_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64_simd::STANDARD.encode_to_string(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: From<Vec<u8>>>(d: D) -> Result<T, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        base64_simd::STANDARD
            .decode_to_vec(text.as_bytes())
            .map(T::from)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    pub(crate) fn fixture(name: &str) -> Vec<u8> {
        let path = format!("{}/tests/fixtures/media/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    #[test]
    fn detect_by_declared_type_then_name_then_bytes() {
        let pdf = fixture("text.pdf");
        let docx = fixture("report.docx");
        let pptx = fixture("slides.pptx");
        let xlsx = fixture("sheet.xlsx");
        assert_eq!(
            DocKind::detect(Some("application/pdf"), None, b""),
            Some(DocKind::Pdf)
        );
        assert_eq!(
            DocKind::detect(Some("Application/PDF; name=x.pdf"), None, b""),
            Some(DocKind::Pdf)
        );
        assert_eq!(
            DocKind::detect(Some(DOCX_TYPE), None, b""),
            Some(DocKind::Docx)
        );
        assert_eq!(
            DocKind::detect(Some(PPTX_TYPE), Some("a.pdf"), b""),
            Some(DocKind::Pptx)
        );
        assert_eq!(
            DocKind::detect(Some(XLSX_TYPE), None, b""),
            Some(DocKind::Xlsx)
        );
        // A declared non-document type is believed.
        assert_eq!(
            DocKind::detect(Some("image/png"), Some("a.pdf"), &pdf),
            None
        );
        assert_eq!(DocKind::detect(Some("text/plain"), None, &pdf), None);
        // Generic types fall through to the name, then the bytes.
        assert_eq!(
            DocKind::detect(Some("application/octet-stream"), Some("Report.DOCX"), b""),
            Some(DocKind::Docx)
        );
        assert_eq!(
            DocKind::detect(None, Some("deck.pptx"), b""),
            Some(DocKind::Pptx)
        );
        assert_eq!(
            DocKind::detect(None, Some("book.xlsx"), b""),
            Some(DocKind::Xlsx)
        );
        assert_eq!(DocKind::detect(None, None, &pdf), Some(DocKind::Pdf));
        assert_eq!(
            DocKind::detect(Some("application/zip"), None, &docx),
            Some(DocKind::Docx)
        );
        assert_eq!(
            DocKind::detect(None, Some("noext"), &pptx),
            Some(DocKind::Pptx)
        );
        assert_eq!(
            DocKind::detect(None, Some("x.bin"), &xlsx),
            Some(DocKind::Xlsx)
        );
        assert_eq!(DocKind::detect(None, None, b"hello"), None);
        assert_eq!(DocKind::detect(None, None, b""), None);
        assert_eq!(DocKind::detect(None, None, b"PK\x03\x04"), None);
        assert_eq!(DocKind::detect(None, Some("photo.png"), b"\x89PNG"), None);
        // Templates, macro-enabled files and slide shows are the same
        // formats.
        for (name, kind) in [
            ("letter.dotx", DocKind::Docx),
            ("macros.docm", DocKind::Docx),
            ("show.ppsx", DocKind::Pptx),
            ("model.xlsm", DocKind::Xlsx),
        ] {
            assert_eq!(DocKind::detect(None, Some(name), b""), Some(kind), "{name}");
        }
        assert_eq!(
            DocKind::detect(
                Some("application/vnd.openxmlformats-officedocument.presentationml.slideshow"),
                None,
                b""
            ),
            Some(DocKind::Pptx)
        );
        assert_eq!(
            DocKind::detect(
                Some("application/vnd.ms-excel.sheet.macroEnabled.12"),
                None,
                b""
            ),
            Some(DocKind::Xlsx)
        );
        for kind in [DocKind::Pdf, DocKind::Docx, DocKind::Pptx, DocKind::Xlsx] {
            assert_eq!(
                DocKind::detect(Some(kind.media_type()), None, b""),
                Some(kind)
            );
        }
        assert_eq!(DocKind::Docx.label(), "DOCX");
        assert_eq!(DocKind::Pptx.unit(), "slide");
        assert_eq!(DocKind::Xlsx.unit(), "sheet");
    }

    #[test]
    fn clean_text_drops_controls_and_blank_runs() {
        let raw = "\n\n a\u{0}b\u{7}\r\nline two  \r\n\n\n\n\tthree\u{c}four\n\n";
        assert_eq!(clean_text(raw), " ab\nline two\n\n\tthree\nfour");
        assert_eq!(clean_text("\u{0}\u{1}\n\n"), "");
    }

    #[test]
    #[cfg(feature = "documents")]
    fn sink_cuts_text_at_a_char_boundary_and_counts_pages() {
        let limits = Limits {
            max_pages: 2,
            max_text_bytes: 5,
            max_unpacked_bytes: 1,
            ..Limits::default()
        };
        let mut sink = PageSink::new(&limits);
        assert!(sink.wants_more());
        sink.push("abcé€", false, vec![]);
        assert!(!sink.wants_more());
        let doc = sink.finish(DocKind::Pdf);
        assert!(doc.truncated);
        assert_eq!(doc.pages[0].text, "abcé");
        assert_eq!(doc.pages[0].number, 1);
    }

    #[test]
    #[cfg(not(feature = "documents"))]
    fn a_build_without_documents_reads_none_and_says_why() {
        for kind in [DocKind::Pdf, DocKind::Docx, DocKind::Pptx, DocKind::Xlsx] {
            let err = read(kind, &fixture("chart.pdf"), &Limits::default()).unwrap_err();
            assert_eq!(err.reason(), without_documents::NOT_BUILT);
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        let err = read_and_render(b"%PDF-1.4", &Limits::default(), &stop, 1, 110.0)
            .err()
            .map(|e| e.reason().to_owned());
        assert_eq!(err.as_deref(), Some(without_documents::NOT_BUILT));
    }

    #[test]
    #[cfg(feature = "documents")]
    fn a_panic_becomes_damaged() {
        let err = guarded::<()>(|| panic!("boom")).unwrap_err();
        assert_eq!(err.to_string(), "damaged: parser panicked (boom)");
    }

    mod fuzz {
        use super::super::*;
        use super::fixture;
        use proptest::prelude::*;

        /// The fixture for each kind, mutated: bytes overwritten, then maybe cut.
        fn mutated(kind: DocKind) -> impl Strategy<Value = Vec<u8>> {
            let base = fixture(match kind {
                DocKind::Pdf => "chart.pdf",
                DocKind::Docx => "report.docx",
                DocKind::Pptx => "slides.pptx",
                DocKind::Xlsx => "sheet.xlsx",
            });
            let len = base.len();
            (
                proptest::collection::vec((0..len, any::<u8>()), 1..16),
                proptest::option::of(0..len),
            )
                .prop_map(move |(edits, cut)| {
                    let mut bytes = base.clone();
                    for (at, byte) in edits {
                        bytes[at] = byte;
                    }
                    if let Some(cut) = cut {
                        bytes.truncate(cut);
                    }
                    bytes
                })
        }

        fn kinds() -> impl Strategy<Value = DocKind> {
            prop_oneof![
                Just(DocKind::Pdf),
                Just(DocKind::Docx),
                Just(DocKind::Pptx),
                Just(DocKind::Xlsx)
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]

            #[test]
            fn random_bytes_never_panic(kind in kinds(), bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
                let _ = read(kind, &bytes, &Limits::default());
                let _ = DocKind::detect(None, None, &bytes);
            }

            #[test]
            fn mutated_pdf_never_panics(bytes in mutated(DocKind::Pdf)) {
                let limits = Limits::default();
                if let Ok(doc) = read(DocKind::Pdf, &bytes, &limits) {
                    prop_assert!(doc.pages.len() <= limits.max_pages);
                    for page in &doc.pages {
                        prop_assert!(!page.text.contains('\0'));
                    }
                }
            }

            #[test]
            fn mutated_docx_never_panics(bytes in mutated(DocKind::Docx)) {
                let _ = read(DocKind::Docx, &bytes, &Limits::default());
            }

            #[test]
            fn mutated_pptx_never_panics(bytes in mutated(DocKind::Pptx)) {
                let _ = read(DocKind::Pptx, &bytes, &Limits::default());
            }

            #[test]
            fn mutated_xlsx_never_panics(bytes in mutated(DocKind::Xlsx)) {
                let _ = read(DocKind::Xlsx, &bytes, &Limits::default());
            }
        }
    }
}
