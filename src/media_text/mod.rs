//! What turns media into text, below the proxy: documents and audio for a
//! model that cannot take them, and the calls that make the text (the
//! describer and transcriber in [`describe`]). The async edge around the
//! pure parts. A PDF or Office file is read
//! ([`crate::media`], on the blocking pool), its pages that hold figures
//! or no text are rendered and described, its embedded images described
//! (the `[describer]`), and the whole text is kept under the document's
//! SHA-256 (memory and store), so the next request that carries it costs a
//! lookup. Audio is written down by the `[transcriber]`. Nothing here fails
//! a request: what cannot be read or heard becomes one line that says why.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;
use tokio::time::Instant;

pub mod describe;

use crate::media::{self, DocKind, Document, Limits};
use crate::metrics::Metrics;
use crate::transform::placeholder::{audio_text, document_header, unreadable};
use crate::transform::{MediaJob, Medium, Payload, Subject, decode::sha256_hex, subject_key};
use describe::{Credential, Describer, PROMPT_VERSION, describe};

/// The part that turns a request's documents and audio into text: the
/// describer and transcriber it calls, and the `[documents]` bounds,
/// resolved once at start.
pub struct MediaText {
    describer: Arc<Describer>,
    transcriber: Arc<Describer>,
    metrics: Arc<Metrics>,
    /// `documents.max_pages_described`.
    max_pages_described: usize,
    /// `documents.max_document_chars` (see [`document_chars`]).
    max_document_chars: usize,
    /// `documents.max_request_chars` (see [`request_chars`]).
    request_chars: usize,
    /// The child reader, when `documents.isolate` finds one.
    reader: Option<Worker>,
    /// `documents.isolate`, for [`MediaText::reader_note`].
    isolate: bool,
}

impl MediaText {
    /// The part for `config`, calling `describer` and `transcriber`.
    pub fn new(
        config: &crate::config::Config,
        describer: Arc<Describer>,
        transcriber: Arc<Describer>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let documents = &config.documents;
        Self {
            describer,
            transcriber,
            metrics,
            max_pages_described: documents.max_pages_described as usize,
            max_document_chars: document_chars(documents),
            request_chars: request_chars(config),
            // A build without document readers starts no child to learn so.
            reader: cfg!(feature = "documents")
                .then(|| reader(documents))
                .flatten(),
            isolate: documents.isolate,
        }
    }

    /// The describer (images, and the pages of documents).
    pub fn describer(&self) -> &Arc<Describer> {
        &self.describer
    }

    /// The transcriber (speech).
    pub fn transcriber(&self) -> &Arc<Describer> {
        &self.transcriber
    }

    /// How documents are read, for the start-up log line.
    pub fn reader_note(&self) -> String {
        if !cfg!(feature = "documents") {
            return format!("not read: {}", media::NOT_BUILT);
        }
        reader_note(self.reader.as_ref(), self.isolate)
    }
}

/// Pages are rendered for the describer at this resolution.
const RENDER_DPI: f32 = 110.0;

/// How long a document waits for a reader (see [`readers`]) before it is
/// left unread.
const READER_WAIT: Duration = Duration::from_secs(30);

/// Documents read or rendered at once, over the process: one per core (the
/// work is CPU-bound; more would only slow each other and the proxy).
fn readers() -> &'static Semaphore {
    static READERS: OnceLock<Semaphore> = OnceLock::new();
    READERS.get_or_init(|| {
        Semaphore::new(std::thread::available_parallelism().map_or(2, std::num::NonZero::get))
    })
}

/// Sets the flag when dropped: the request future that owns it is gone (or
/// done), so the blocking read it started stops at its next check.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The text made for one document or audio, and the `action` label of
/// `visor_media_total` it counts under.
pub struct Made {
    pub sha256: String,
    pub text: Arc<str>,
    pub action: &'static str,
}

/// Credentials for the two services a request's media may need.
#[derive(Clone, Default)]
pub struct Credentials {
    pub describer: Credential,
    pub transcriber: Credential,
}

/// What bounds the media of one request: when to stop reading (documents
/// still unread then, audio not yet heard, pages not yet described say
/// "out of time"), and how many characters of document text the request
/// may carry over all its documents (`documents.max_request_chars`).
#[derive(Debug, Clone, Copy)]
pub struct Within {
    pub stop_at: Option<Instant>,
    pub chars: usize,
}

impl Within {
    /// No deadline; the configured per-request text budget.
    pub fn unbounded_time(media: &MediaText) -> Self {
        Self {
            stop_at: None,
            chars: media.request_chars,
        }
    }
}

/// `documents.max_request_chars`, or when unset the default: 1,000,000
/// characters, or `server.max_body_bytes / 8` when that is smaller (a
/// character is at most 4 bytes of UTF-8, and JSON may escape it to 2).
pub fn request_chars(config: &crate::config::Config) -> usize {
    let derived = (config.server.max_body_bytes / 8).min(DEFAULT_REQUEST_CHARS);
    usize::try_from(config.documents.max_request_chars.unwrap_or(derived)).unwrap_or(usize::MAX)
}

/// The default of `documents.max_request_chars` (unless
/// `server.max_body_bytes / 8` is smaller).
pub const DEFAULT_REQUEST_CHARS: u64 = 1_000_000;

/// Waits for `fut` until `stop_at` (never, without one); `None`: out of
/// time.
pub async fn until<T>(
    stop_at: Option<Instant>,
    fut: impl std::future::Future<Output = T>,
) -> Option<T> {
    match stop_at {
        Some(at) => tokio::time::timeout_at(at, fut).await.ok(),
        None => Some(fut.await),
    }
}

/// Why a document or audio was left unread at the deadline.
pub const OUT_OF_TIME: &str = "not read: out of time";

/// The text for each job: audio transcribed concurrently, documents read
/// one after another (a request takes at most one of the process's
/// readers, so one request with many documents never starves the others).
pub async fn make(
    media: &MediaText,
    jobs: Vec<MediaJob>,
    describe_pages: bool,
    creds: &Credentials,
) -> Vec<Made> {
    make_within(
        media,
        jobs,
        describe_pages,
        creds,
        Within::unbounded_time(media),
    )
    .await
}

/// [`make`] within a deadline and a text budget: what is not done by
/// `within.stop_at` says "out of time"; documents are cut to what is left
/// of `within.chars` (in request order), and those after it is spent are
/// not read.
pub async fn make_within(
    media: &MediaText,
    jobs: Vec<MediaJob>,
    describe_pages: bool,
    creds: &Credentials,
    within: Within,
) -> Vec<Made> {
    let (audio, documents): (Vec<_>, Vec<_>) = jobs
        .into_iter()
        .partition(|j| matches!(j.medium, Medium::Audio { .. }));
    let heard = futures_util::future::join_all(audio.into_iter().map(|job| async {
        let (sha256, media_type) = (job.sha256.clone(), job.media_type.clone());
        match until(within.stop_at, transcribe(media, job, &creds.transcriber)).await {
            Some(made) => made,
            None => Made {
                text: Arc::from(unreadable(
                    "audio",
                    &sha256,
                    &media_type,
                    None,
                    "not transcribed: out of time",
                )),
                sha256,
                action: "stripped",
            },
        }
    }));
    let read = async {
        let mut made = Vec::with_capacity(documents.len());
        let mut left = within.chars;
        for job in documents {
            let name = match &job.medium {
                Medium::Document { name, .. } => name.clone(),
                _ => None,
            };
            if left == 0 {
                made.push(failed(
                    job,
                    name,
                    "not read: over this request's document text budget (documents.max_request_chars)",
                ));
                continue;
            }
            let sha256 = job.sha256.clone();
            let span = crate::telemetry::child(
                "read document",
                vec![opentelemetry::KeyValue::new(
                    "visor.media.type",
                    job.media_type.to_string(),
                )],
            );
            let read = document(media, job.clone(), describe_pages, &creds.describer, within);
            let Some(mut m) = until(within.stop_at, read).await else {
                if let Some(s) = &span {
                    s.failed(OUT_OF_TIME);
                }
                made.push(failed(job, name, OUT_OF_TIME));
                continue;
            };
            if let Some(s) = &span {
                s.set([opentelemetry::KeyValue::new("visor.media.action", m.action)]);
            }
            if m.action == "described" {
                let chars = m.text.chars().count();
                if chars > left {
                    m.text = Arc::from(cut(&m.text, left, "documents.max_request_chars"));
                    left = 0;
                } else {
                    left -= chars;
                }
            }
            debug_assert_eq!(m.sha256, sha256);
            made.push(m);
        }
        made
    };
    let (mut made, read) = futures_util::future::join(heard, read).await;
    made.extend(read);
    for m in &made {
        let kind = if m.action == "transcribed" || m.text.starts_with("[audio ") {
            "audio"
        } else {
            "document"
        };
        media
            .metrics
            .media
            .with_label_values(&[kind, m.action])
            .inc();
    }
    made
}

/// `text` cut at `max` characters, with a line saying where, of how many,
/// and which bound cut it (`documents.max_document_chars`, …); as it is
/// when it is within.
pub fn cut(text: &str, max: usize, why: &str) -> String {
    // A text cut before keeps saying so (its line is replaced, not cut).
    let (body, before) = match text.rfind(CUT_NOTE) {
        Some(i) if !text[i + 1..].contains('\n') && text.ends_with(']') => {
            let note = &text[i + 2..text.len() - 1];
            (
                &text[..i],
                Some(note.strip_prefix("visor: ").unwrap_or(note)),
            )
        }
        _ => (text, None),
    };
    let Some((at, _)) = body.char_indices().nth(max) else {
        return text.to_owned();
    };
    let total = max + body[at..].chars().count();
    let before = before
        .map(|b| format!("; before that, {b}"))
        .unwrap_or_default();
    format!(
        "{}\n[visor: document text cut at {max} characters of {total} ({why}){before}]",
        &body[..at]
    )
}

/// How the line saying a document's text was cut begins.
const CUT_NOTE: &str = "\n[visor: document text cut at ";

/// A document's text cut at `max` characters (`documents.max_document_chars`);
/// `unread`: the reader stopped at its budget, so there was more than it
/// says.
fn cut_document(text: String, max: usize, unread: bool) -> String {
    let Some((at, _)) = text.char_indices().nth(max) else {
        return text;
    };
    match unread {
        true => format!(
            "{}\n[visor: document text cut at {max} characters (documents.max_document_chars); the rest of the document was not read]",
            &text[..at]
        ),
        false => cut(&text, max, "documents.max_document_chars"),
    }
}

async fn transcribe(media: &MediaText, job: MediaJob, cred: &Credential) -> Made {
    let subject = Subject {
        sha256: job.sha256.clone(),
        payload: Payload::Inline {
            media_type: job.media_type.clone(),
            bytes: job.bytes.clone(),
        },
        lookup_only: false,
        query: None,
    };
    let transcript = describe(&media.transcriber, vec![subject], cred).await;
    match transcript.into_iter().next() {
        Some((_, t)) => Made {
            text: Arc::from(audio_text(&job.sha256, &job.media_type, &t)),
            sha256: job.sha256,
            action: "transcribed",
        },
        None => Made {
            text: Arc::from(unreadable(
                "audio",
                &job.sha256,
                &job.media_type,
                None,
                "transcriber unavailable",
            )),
            sha256: job.sha256,
            action: "stripped",
        },
    }
}

/// A document's content: parsed pages, or the text of a text document.
#[derive(Serialize, Deserialize)]
enum Content {
    Parsed(Document),
    Plain(String),
}

/// What a document was read into, off the worker thread (or in the child
/// process, and sent back as JSON): its pages, and the pictures to
/// describe (rendered pages, embedded images).
#[derive(Serialize, Deserialize)]
struct Read {
    kind: Option<DocKind>,
    doc: Result<Content, String>,
    pictures: Vec<Picture>,
    /// Pages that needed a look but could not be rendered, and why.
    unrendered: Vec<(usize, String)>,
    /// Pages that needed a look, within the budget, not rendered because
    /// the describer is unavailable.
    unseen: Vec<usize>,
    /// Some pages were not rendered for a reason that may not hold next
    /// time (a busy machine): the text is not kept.
    #[serde(default)]
    transient: bool,
}

#[derive(Serialize, Deserialize)]
struct Picture {
    page: usize,
    /// `page 3` (a rendered page) or an embedded image's name.
    label: String,
    media_type: String,
    #[serde(with = "media::base64_bytes")]
    bytes: bytes::Bytes,
    /// Rendered from the document (its key is the document's hash and
    /// page); else an embedded image known by its own hash.
    rendered: bool,
}

async fn document(
    media: &MediaText,
    job: MediaJob,
    describe_pages: bool,
    cred: &Credential,
    within: Within,
) -> Made {
    let name = match &job.medium {
        Medium::Document { name, .. } => name.clone(),
        _ => None,
    };
    if !cfg!(feature = "documents") {
        // Before a reader's slot is taken: there is nothing to read with.
        return failed(
            job,
            name,
            &format!("could not be read: {}", media::NOT_BUILT),
        );
    }
    let budget = if describe_pages {
        media.max_pages_described
    } else {
        0
    };
    let max_chars = media.max_document_chars;
    let key = document_key(media, &job, budget, max_chars);
    if let Some(text) = media.describer.cached(&key).await {
        return Made {
            sha256: job.sha256,
            text,
            action: "described",
        };
    }
    // Rendering is skipped while the describer is backing off: nothing
    // would describe the pages.
    let describer_up = !media.describer.is_backing_off();
    let wait = Instant::now() + READER_WAIT;
    let permit = match tokio::time::timeout_at(wait, readers().acquire()).await {
        Ok(Ok(permit)) => permit,
        // Waited until the request's deadline came first.
        Err(_) if within.stop_at.is_some_and(|at| at <= wait) => {
            return failed(job, name, OUT_OF_TIME);
        }
        _ => return failed(job, name, "could not be read: all readers busy"),
    };
    let ask = Ask {
        media_type: job.media_type.clone(),
        name: name.clone(),
        budget,
        render: if describer_up { budget } else { 0 },
        max_chars,
    };
    let read = match read_with(media.reader.as_ref(), permit, ask, job.bytes.clone()).await {
        Ok(read) => read,
        Err(why) => return failed(job, name, &format!("could not be read: {why}")),
    };
    let doc = match &read.doc {
        Ok(Content::Parsed(d)) => d,
        Ok(Content::Plain(text)) => {
            let text = cut_document(plain(&job, name.as_deref(), text), max_chars, false);
            return Made {
                text: Arc::from(text),
                sha256: job.sha256,
                action: "described",
            };
        }
        Err(e) => return failed(job, name, &format!("could not be read: {e}")),
    };
    let (mut notes, mut complete) =
        describe_pictures(media, &job, &read.pictures, cred, within).await;
    let (pages, pages_complete) = page_notes(media, &job, &read).await;
    notes.extend(pages);
    complete &= pages_complete && !read.transient;
    let unit = read.kind.map_or("page", DocKind::unit);
    let why_not = match describe_pages {
        true => "over documents.max_pages_described",
        false => "images.non_vision = \"strip\"",
    };
    let unread = doc.stopped.as_deref() == Some(media::TEXT_BUDGET);
    let text = compose(
        &job,
        name.as_deref(),
        doc,
        unit,
        &notes,
        &read.pictures,
        why_not,
    );
    let text: Arc<str> = Arc::from(cut_document(text, max_chars, unread));
    if complete {
        media.describer.remember(&key, text.clone()).await;
    }
    Made {
        sha256: job.sha256,
        text,
        action: "described",
    }
}

/// Reads a document: in a child process when there is a `worker`, else on
/// the blocking pool; `permit` (one of the process's readers) is held until
/// the read is over.
async fn read_with(
    worker: Option<&Worker>,
    permit: tokio::sync::SemaphorePermit<'static>,
    ask: Ask,
    bytes: bytes::Bytes,
) -> Result<Read, String> {
    let Some(worker) = worker else {
        let stop = Arc::new(AtomicBool::new(false));
        let _stop_on_drop = StopOnDrop(stop.clone());
        return tokio::task::spawn_blocking(move || {
            // Held by the read itself: a request dropped mid-read keeps its
            // reader until the read notices.
            let _permit = permit;
            read(&bytes, &ask, &stop)
        })
        .await
        .map_err(|_| "the reader stopped".to_owned());
    };
    // The permit is held until the child is gone (a request dropped
    // mid-read kills it: `kill_on_drop`).
    let mut read = read_in_child(worker, &ask, &bytes).await;
    let pdf =
        DocKind::detect(Some(&ask.media_type), ask.name.as_deref(), &bytes) == Some(DocKind::Pdf);
    if let (Err(failed), true) = (&read, pdf && ask.render > 0) {
        // Rendering is where a hostile PDF costs most: its text alone, the
        // pages it would have rendered saying why not.
        let failed = failed.clone();
        let text_only = Ask { render: 0, ..ask };
        read = read_in_child(worker, &text_only, &bytes)
            .await
            .map(|mut r| {
                let unrendered = std::mem::take(&mut r.unseen);
                r.unrendered = unrendered
                    .into_iter()
                    .map(|p| (p, failed.why.clone()))
                    .collect();
                // A limit of the file's own making is met again next time:
                // kept. A busy machine is not.
                r.transient = !failed.repeatable;
                r
            });
    }
    drop(permit);
    read.map_err(|e| e.why)
}

/// A line for each picture a document's read gave (a rendered page, an
/// embedded image): its description, or why it has none; false when one
/// has none (the text is then not kept: next time it may be described).
async fn describe_pictures(
    media: &MediaText,
    job: &MediaJob,
    pictures: &[Picture],
    cred: &Credential,
    within: Within,
) -> (Vec<(usize, String)>, bool) {
    let subjects: Vec<Subject> = pictures
        .iter()
        .map(|p| Subject {
            sha256: picture_sha(&job.sha256, p),
            payload: Payload::Inline {
                media_type: p.media_type.clone(),
                bytes: p.bytes.clone(),
            },
            lookup_only: false,
            query: job.query.clone(),
        })
        .collect();
    // Pages still undescribed at the request's deadline say so.
    let mut late = false;
    let descriptions = match subjects.is_empty() {
        true => Vec::new(),
        false => match until(within.stop_at, describe(&media.describer, subjects, cred)).await {
            Some(d) => d,
            None => {
                late = true;
                Vec::new()
            }
        },
    };
    let unavailable = match late {
        true => "out of time",
        false => "describer unavailable",
    };
    let described = |p: &Picture| {
        let k = subject_key(&picture_sha(&job.sha256, p), job.query.as_deref());
        descriptions
            .iter()
            .find(|(s, _)| *s == k)
            .map(|(_, d)| d.clone())
    };
    let mut complete = true;
    let mut notes = Vec::with_capacity(pictures.len());
    for p in pictures {
        match described(p) {
            Some(d) => notes.push((p.page, format!("[{} described: {}]", p.label, one_line(&d)))),
            None => {
                complete = false;
                let note = format!("[{}: not described, {unavailable}]", p.label);
                notes.push((p.page, note));
            }
        }
    }
    (notes, complete)
}

/// A line for each page that needed a look and was not rendered: why it
/// could not be, or (the describer backing off) its description from an
/// earlier turn; false when one has neither.
async fn page_notes(
    media: &MediaText,
    job: &MediaJob,
    read: &Read,
) -> (Vec<(usize, String)>, bool) {
    let mut complete = true;
    let mut notes = Vec::new();
    for (page, why) in &read.unrendered {
        // (A page stopped by a budget is kept as read, like the rest of
        // the document: later turns then send the same text, and do not
        // spend the time again. A cancelled read is never seen here: its
        // request, and this future, are gone.)
        notes.push((
            *page,
            format!("[page {page}: figures, not described: could not be rendered: {why}]"),
        ));
    }
    for &page in &read.unseen {
        let id = subject_key(&format!("{}.p{page}", job.sha256), job.query.as_deref());
        match media.describer.cached(&media.describer.key(&id)).await {
            Some(d) => notes.push((page, format!("[page {page} described: {}]", one_line(&d)))),
            None => {
                complete = false;
                notes.push((
                    page,
                    format!("[page {page}: figures, not described: describer unavailable]"),
                ));
            }
        }
    }
    (notes, complete)
}

/// The text of a document without descriptions (`visor explain`, which
/// calls no model): its pages, and a line for each that would be
/// described. Audio gets the line that says it was not transcribed.
pub fn offline(job: &MediaJob) -> Made {
    let name = match &job.medium {
        Medium::Document { name, .. } => name.clone(),
        Medium::Audio { .. } | Medium::Image => {
            return Made {
                text: Arc::from(unreadable(
                    "audio",
                    &job.sha256,
                    &job.media_type,
                    None,
                    "not transcribed by visor explain",
                )),
                sha256: job.sha256.clone(),
                action: "stripped",
            };
        }
    };
    let max_chars = DEFAULT_DOCUMENT_CHARS as usize;
    let ask = Ask {
        media_type: job.media_type.clone(),
        name: name.clone(),
        budget: 0,
        render: 0,
        max_chars,
    };
    let read = read(&job.bytes, &ask, &AtomicBool::new(false));
    let why_not = "visor explain calls no describer";
    let (text, action) = match read.doc {
        Ok(Content::Parsed(doc)) => {
            let unit = read.kind.map_or("page", DocKind::unit);
            let unread = doc.stopped.as_deref() == Some(media::TEXT_BUDGET);
            let text = compose(job, name.as_deref(), &doc, unit, &[], &[], why_not);
            (cut_document(text, max_chars, unread), "described")
        }
        Ok(Content::Plain(text)) => (
            cut_document(plain(job, name.as_deref(), &text), max_chars, false),
            "described",
        ),
        Err(e) => (
            unreadable(
                "document",
                &job.sha256,
                &job.media_type,
                name.as_deref(),
                &format!("could not be read: {e}"),
            ),
            "stripped",
        ),
    };
    Made {
        text: Arc::from(text),
        sha256: job.sha256.clone(),
        action,
    }
}

fn plain(job: &MediaJob, name: Option<&str>, text: &str) -> String {
    let head = document_header(&job.sha256, &job.media_type, name, 1, "page");
    format!("{head}\n{}", text.trim())
}

fn failed(job: MediaJob, name: Option<String>, why: &str) -> Made {
    Made {
        text: Arc::from(unreadable(
            "document",
            &job.sha256,
            &job.media_type,
            name.as_deref(),
            why,
        )),
        sha256: job.sha256,
        action: "stripped",
    }
}

/// What the child reader is asked: the document's type and name, how many
/// pictures to make and how many pages to render, how many characters of
/// text to read at most (then the bytes).
#[derive(Clone, Serialize, Deserialize)]
struct Ask {
    media_type: String,
    name: Option<String>,
    budget: usize,
    render: usize,
    #[serde(default = "unbounded_chars")]
    max_chars: usize,
}

fn unbounded_chars() -> usize {
    usize::MAX
}

/// The default of `documents.max_document_chars`.
pub const DEFAULT_DOCUMENT_CHARS: u64 = 150_000;

/// `documents.max_document_chars`: the most characters one document's
/// text is (header and notes included); its reader stops there.
pub fn document_chars(cfg: &crate::config::Documents) -> usize {
    usize::try_from(cfg.max_document_chars).unwrap_or(usize::MAX)
}

/// The child reader's limits and binary (`[documents]`).
struct Worker {
    binary: std::path::PathBuf,
    memory_mib: u64,
    cpu_secs: u64,
}

/// The binary that reads documents in a child process, when
/// `documents.isolate`: `reader_binary`, else this executable when it is
/// visor's (named `visor…`; on Linux by `/proc/self/exe`, the same file even
/// after an upgrade replaced it on disk). A test harness or a bench that
/// embeds the library reads on a thread unless it names the binary.
fn reader(cfg: &crate::config::Documents) -> Option<Worker> {
    if !cfg.isolate {
        return None;
    }
    let binary = match &cfg.reader_binary {
        Some(b) => b.clone(),
        None => {
            let exe = std::env::current_exe().ok()?;
            if !exe.file_name()?.to_str()?.starts_with("visor") {
                return None;
            }
            let proc_exe = std::path::Path::new("/proc/self/exe");
            match cfg!(target_os = "linux") && proc_exe.exists() {
                true => proc_exe.to_path_buf(),
                false => exe,
            }
        }
    };
    Some(Worker {
        binary,
        memory_mib: cfg.reader_memory_mib,
        cpu_secs: cfg.reader_cpu_secs,
    })
}

/// How documents are read: by `reader`, else on threads.
fn reader_note(reader: Option<&Worker>, isolate: bool) -> String {
    match reader {
        Some(w) => format!(
            "in a child process ({}, {} MiB, {} s of CPU)",
            w.binary.display(),
            w.memory_mib,
            w.cpu_secs
        ),
        None if isolate => {
            "on threads of this process (isolate = true, but this executable is not visor: set documents.reader_binary)".to_owned()
        }
        None => "on threads of this process (isolate = false)".to_owned(),
    }
}

/// The most a child reader may answer (its text is bounded far below).
const MAX_WORKER_ANSWER: u64 = 512 << 20;

/// Why a child reader gave no answer; `repeatable`: a limit the file
/// itself runs into (it would again), not the machine's state.
#[derive(Clone)]
struct ChildError {
    why: String,
    repeatable: bool,
}

impl ChildError {
    fn transient(why: &str) -> Self {
        Self {
            why: why.to_owned(),
            repeatable: false,
        }
    }
}

/// Exit status of a child that could not hold the document in memory.
const EXIT_TOO_LARGE: u8 = 4;
/// Exit status of a child whose limits could not be set.
const EXIT_LIMITS: u8 = 3;

/// Reads the document in a child process: `visor media-worker` with the
/// limits in its arguments, the ask and the bytes on its stdin, the
/// [`Read`] as JSON on its stdout. A child that is killed (its CPU limit,
/// the wall-clock limit here, memory) is a reason, never an error of the
/// request.
async fn read_in_child(worker: &Worker, ask: &Ask, bytes: &[u8]) -> Result<Read, ChildError> {
    use std::process::Stdio;
    let mut child = tokio::process::Command::new(&worker.binary)
        .arg("media-worker")
        .arg(worker.memory_mib.to_string())
        .arg(worker.cpu_secs.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        // Defence in depth: the proxy's environment (its keys) is not
        // handed to a process that parses what clients send.
        .env_clear()
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            tracing::warn!(binary = %worker.binary.display(), error = %e, "cannot start the document reader");
            ChildError::transient("the reader could not be started")
        })?;
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Err(ChildError::transient("the reader could not be started"));
    };
    let mut head = serde_json::to_vec(ask).map_err(|e| ChildError::transient(&e.to_string()))?;
    head.push(b'\n');
    let write = async move {
        // A child that stops reading (it died) ends the write early.
        let _ = stdin.write_all(&head).await;
        let _ = stdin.write_all(bytes).await;
    };
    let read = async move {
        let mut out = Vec::new();
        let _ = stdout.take(MAX_WORKER_ANSWER).read_to_end(&mut out).await;
        out
    };
    let limit = Duration::from_secs(worker.cpu_secs.saturating_add(5));
    let done = tokio::time::timeout(limit, async {
        let ((), out) = futures_util::future::join(write, read).await;
        (out, child.wait().await)
    })
    .await;
    let Ok((out, status)) = done else {
        let _ = child.kill().await;
        return Err(ChildError::transient("over the wall-clock limit"));
    };
    match status {
        Ok(s) if s.success() => {
            // Tens of MB of JSON for a rendered document: off the runtime.
            tokio::task::spawn_blocking(move || serde_json::from_slice::<Read>(&out))
                .await
                .ok()
                .and_then(Result::ok)
                .ok_or_else(|| ChildError::transient("the reader's answer was damaged"))
        }
        Ok(s) => Err(died(s)),
        Err(e) => Err(ChildError::transient(&format!("the reader failed ({e})"))),
    }
}

/// Why a child reader ended without an answer.
fn died(status: std::process::ExitStatus) -> ChildError {
    let limit = |why: &str| ChildError {
        why: why.to_owned(),
        repeatable: true,
    };
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        // SIGXCPU (24): its CPU limit. SIGABRT (6): an allocation over its
        // address-space limit aborts it ("memory allocation of N bytes
        // failed"). SIGKILL (9), not sent here but on the wall-clock limit
        // (answered above): the kernel's OOM killer.
        match status.signal() {
            Some(24) => return limit("over the time budget"),
            Some(6) => return limit("over the memory budget"),
            Some(9) => return ChildError::transient("the reader was killed"),
            Some(n) => return limit(&format!("the reader stopped (signal {n})")),
            None => {}
        }
    }
    match status.code() {
        Some(c) if c == i32::from(EXIT_TOO_LARGE) => limit("over the memory budget"),
        Some(c) => {
            tracing::warn!(status = c, "document reader exited without an answer");
            ChildError::transient(&format!("the reader stopped (exit status {c})"))
        }
        None => ChildError::transient("the reader stopped"),
    }
}

/// `visor media-worker MEMORY_MIB CPU_SECS`: reads one document from stdin
/// (an [`Ask`] line, then its bytes) under those limits (never above the
/// hard limits it was started with) and writes what it read to stdout as
/// JSON. No core files. Exit status 0 when it wrote an answer.
pub fn worker_main(memory_mib: u64, cpu_secs: u64) -> std::process::ExitCode {
    use rlimit::Resource;
    use std::io::{Read as _, Write as _};
    use std::process::ExitCode;
    let set = |resource: Resource, want: u64| {
        let hard = resource.get().map_or(want, |(_, hard)| hard);
        let value = want.min(hard);
        resource.set(value, hard)
    };
    let limited = set(Resource::CORE, 0)
        .and(set(Resource::AS, memory_mib.saturating_mul(1 << 20)))
        .and(set(Resource::CPU, cpu_secs));
    if limited.is_err() {
        return ExitCode::from(EXIT_LIMITS);
    }
    let mut input = Vec::new();
    match std::io::stdin().read_to_end(&mut input) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::OutOfMemory => {
            return ExitCode::from(EXIT_TOO_LARGE);
        }
        Err(_) => return ExitCode::from(2),
    }
    let Some(nl) = memchr::memchr(b'\n', &input) else {
        return ExitCode::from(2);
    };
    let Ok(ask) = serde_json::from_slice::<Ask>(&input[..nl]) else {
        return ExitCode::from(2);
    };
    let doc = &input[nl + 1..];
    let mut read = read(doc, &ask, &AtomicBool::new(false));
    // An Office file's images travel once, as pictures (the pages keep
    // their names and count).
    if let Ok(Content::Parsed(d)) = &mut read.doc {
        for img in d.pages.iter_mut().flat_map(|p| p.images.iter_mut()) {
            img.bytes = Vec::new();
        }
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    match serde_json::to_writer(&mut out, &read).map(|()| out.flush()) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        _ => ExitCode::from(2),
    }
}

/// The key a document's whole text is kept under: its hash, the reader's
/// version, the describer model and prompt, how many pages may be
/// described, and the query.
fn document_key(media: &MediaText, job: &MediaJob, budget: usize, max_chars: usize) -> String {
    let d = &media.describer;
    let q = subject_key("", job.query.as_deref());
    // The text's header names the file and its type: the same bytes under
    // another name or type are another text.
    let name = match &job.medium {
        Medium::Document { name, .. } => name.as_deref().unwrap_or(""),
        _ => "",
    };
    let named = sha256_hex(format!("{}\0{name}", job.media_type).as_bytes());
    format!(
        "document/{}/r{}/{}/v{PROMPT_VERSION}/p{budget}/c{max_chars}/n{}{q}",
        job.sha256,
        media::READER_VERSION,
        d.model(),
        &named[..16]
    )
}

fn picture_sha(doc_sha: &str, p: &Picture) -> String {
    match p.rendered {
        true => format!("{doc_sha}.p{}", p.page),
        false => sha256_hex(&p.bytes),
    }
}

/// Reads the document and renders (or takes) the pictures to describe:
/// PDF pages that draw figures or hold no text, Office images, at most
/// `budget`, in page order; PDF pages are rendered only up to `render` (the
/// rest within `budget` are `unseen`); at most `max_chars` characters of
/// text are read. `stop` set: the read stops early.
fn read(bytes: &[u8], ask: &Ask, stop: &AtomicBool) -> Read {
    let (media_type, name) = (ask.media_type.as_str(), ask.name.as_deref());
    let (budget, render) = (ask.budget, ask.render);
    let kind = DocKind::detect(Some(media_type), name, bytes);
    let Some(kind) = kind else {
        // Not a document visor parses: text when it is text.
        let doc = match std::str::from_utf8(bytes) {
            Ok(text) if !text.contains(|c: char| c.is_control() && !c.is_whitespace()) => {
                // (No larger than the request that carried it; cut, and
                // counted, by the caller.)
                Ok(Content::Plain(text.to_owned()))
            }
            _ => Err(format!(
                "{media_type} is not a document visor reads (PDF, DOCX, PPTX, XLSX, text)"
            )),
        };
        return Read {
            kind: None,
            doc,
            pictures: Vec::new(),
            unrendered: Vec::new(),
            unseen: Vec::new(),
            transient: false,
        };
    };
    let mut pictures = Vec::new();
    let mut unrendered = Vec::new();
    let mut unseen = Vec::new();
    let limits = Limits {
        max_text_chars: ask.max_chars,
        ..Limits::default()
    };
    if kind == DocKind::Pdf {
        let read = media::read_and_render(bytes, &limits, stop, render.min(budget), RENDER_DPI);
        let doc = match read {
            Ok(r) => {
                for (page, png) in r.rendered {
                    match png {
                        Ok(png) => pictures.push(Picture {
                            page,
                            label: format!("{} {page}", kind.unit()),
                            media_type: "image/png".to_owned(),
                            bytes: bytes::Bytes::from(png),
                            rendered: true,
                        }),
                        Err(e) => unrendered.push((page, e.to_string())),
                    }
                }
                if render < budget {
                    unseen = r
                        .doc
                        .pages
                        .iter()
                        .filter(|p| p.needs_look)
                        .map(|p| p.number)
                        .skip(render)
                        .take(budget - render)
                        .collect();
                }
                Ok(Content::Parsed(r.doc))
            }
            Err(e) => Err(e.to_string()),
        };
        return Read {
            kind: Some(kind),
            doc,
            pictures,
            unrendered,
            unseen,
            transient: false,
        };
    }
    let doc = media::read(kind, bytes, &limits).map_err(|e| e.to_string());
    if let Ok(d) = &doc {
        for page in &d.pages {
            for img in &page.images {
                if pictures.len() >= budget {
                    break;
                }
                pictures.push(Picture {
                    page: page.number,
                    label: format!("image {}", img.name),
                    media_type: img.media_type.clone(),
                    bytes: bytes::Bytes::from(img.bytes.clone()),
                    rendered: false,
                });
            }
        }
    }
    Read {
        kind: Some(kind),
        doc: doc.map(Content::Parsed),
        pictures,
        unrendered,
        unseen,
        transient: false,
    }
}

/// The text that replaces a document: its header, then each page's text
/// under `--- page N ---`, each picture's description after its page's
/// text, and a line for pages with figures nobody described.
fn compose(
    job: &MediaJob,
    name: Option<&str>,
    doc: &Document,
    unit: &str,
    notes: &[(usize, String)],
    pictures: &[Picture],
    why_not: &str,
) -> String {
    let mut out = document_header(&job.sha256, &job.media_type, name, doc.pages.len(), unit);
    for page in &doc.pages {
        let _ = write!(out, "\n--- {unit} {} ---", page.number);
        let text = page.text.trim();
        if !text.is_empty() {
            out.push('\n');
            out.push_str(text);
        }
        for (_, note) in notes.iter().filter(|(p, _)| *p == page.number) {
            out.push('\n');
            out.push_str(note);
        }
        let pictured = pictures.iter().any(|p| p.page == page.number)
            || notes.iter().any(|(p, _)| *p == page.number);
        // (An Office page's images are listed on their own, below.)
        if page.needs_look && !pictured && page.images.is_empty() {
            let what = if text.is_empty() {
                "no text"
            } else {
                "figures"
            };
            let _ = write!(
                out,
                "\n[{unit} {}: {what}, not described: {why_not}]",
                page.number
            );
        }
        let unseen = page.images.len().saturating_sub(
            pictures
                .iter()
                .filter(|p| p.page == page.number && !p.rendered)
                .count(),
        );
        if unseen > 0 {
            let s = if unseen == 1 { "" } else { "s" };
            let _ = write!(out, "\n[{unseen} image{s} not described: {why_not}]");
        }
    }
    if let Some(why) = &doc.stopped {
        let _ = write!(out, "\n[the rest of the document is not shown: {why}]");
    } else if doc.truncated {
        let _ = write!(
            out,
            "\n[the rest of the document is not shown: over {} {unit}s]",
            Limits::default().max_pages
        );
    }
    out
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}
