//! `[documents]`: PDFs and Office files for models that cannot take them —
//! how many pages are described, and the reader's limits.

use std::path::PathBuf;

use serde::Deserialize;

use super::Problems;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDocuments {
    /// Rendered pages (and embedded images) described per document; the
    /// rest keep their text only, with a line that says so.
    #[serde(default = "default_max_pages_described")]
    pub max_pages_described: u32,
    /// Read each document in a child process (this binary, `visor
    /// media-worker`) under memory and CPU limits, so a hostile file can
    /// only end its own reader; false: on a thread of this process.
    #[serde(default = "default_true")]
    pub isolate: bool,
    /// The binary the child runs; default: this executable.
    #[serde(default)]
    pub reader_binary: Option<PathBuf>,
    /// The child's address-space limit, MiB.
    #[serde(default = "default_reader_memory_mib")]
    pub reader_memory_mib: u64,
    /// The child's CPU-time limit, and (with 5 s more) its wall-clock limit.
    #[serde(default = "default_reader_cpu_secs")]
    pub reader_cpu_secs: u64,
    /// Characters one document's text is at most (its reader stops there);
    /// the text says where it was cut.
    #[serde(default = "default_max_document_chars")]
    pub max_document_chars: u64,
    /// Characters of document text one request carries at most, over all
    /// its documents; absent: 1,000,000, or `server.max_body_bytes / 8`
    /// when smaller.
    #[serde(default)]
    pub max_request_chars: Option<u64>,
}

impl Default for RawDocuments {
    fn default() -> Self {
        Self {
            max_pages_described: default_max_pages_described(),
            isolate: true,
            reader_binary: None,
            reader_memory_mib: default_reader_memory_mib(),
            reader_cpu_secs: default_reader_cpu_secs(),
            max_document_chars: default_max_document_chars(),
            max_request_chars: None,
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_max_document_chars() -> u64 {
    150_000
}
fn default_reader_memory_mib() -> u64 {
    1024
}
fn default_reader_cpu_secs() -> u64 {
    10
}
fn default_max_pages_described() -> u32 {
    20
}

/// `[documents]`, checked (the fields as in [`RawDocuments`]).
#[derive(Debug, Clone)]
pub struct Documents {
    pub max_pages_described: u32,
    pub isolate: bool,
    pub reader_binary: Option<PathBuf>,
    /// 256 MiB to 1 TiB.
    pub reader_memory_mib: u64,
    /// Whole seconds (the child's `RLIMIT_CPU`), 1 to 3600.
    pub reader_cpu_secs: u64,
    pub max_document_chars: u64,
    pub max_request_chars: Option<u64>,
}

impl RawDocuments {
    pub(super) fn validate(self, p: &mut Problems) -> Documents {
        if self.reader_memory_mib > 1 << 20 {
            p.bad(
                "documents.reader_memory_mib",
                self.reader_memory_mib,
                "at most 1048576 (1 TiB)",
            );
        }
        if self.reader_cpu_secs > 3600 {
            p.bad(
                "documents.reader_cpu_secs",
                self.reader_cpu_secs,
                "at most 3600",
            );
        }
        if self.reader_memory_mib < 256 {
            p.bad(
                "documents.reader_memory_mib",
                self.reader_memory_mib,
                "must be at least 256 (the reader's own code and a rendered page need that much)",
            );
        }
        p.at_least_one("documents.reader_cpu_secs", self.reader_cpu_secs);
        Documents {
            max_pages_described: self.max_pages_described,
            isolate: self.isolate,
            reader_binary: self.reader_binary,
            reader_memory_mib: self.reader_memory_mib,
            reader_cpu_secs: self.reader_cpu_secs,
            max_document_chars: self.max_document_chars,
            max_request_chars: self.max_request_chars,
        }
    }
}
