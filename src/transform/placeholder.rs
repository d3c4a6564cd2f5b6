//! The text that replaces an image: what it was, why it is not shown, or
//! its description. Always one line, so it stays visor's own on a second
//! pass (see `dedup::is_own`).

use serde::Serialize;

use super::walk::*;

/// Why an image is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The model cannot see images.
    NonVision,
    /// In a tool result more than `keep_turns` assistant turns old.
    AgedOut,
    /// Beyond the newest `max_per_request` images (or the model's
    /// `max_images`).
    Capped,
    /// A later copy of an image (document, audio) that appears earlier in
    /// the request.
    Deduped,
    /// A document or audio the model does not take (the table's `pdf`,
    /// `office`, `audio`).
    CannotTake,
    /// Base64 of an image in a text where the API takes no image part (a
    /// Chat `tool` message): never sent to a model as text.
    AsText,
}

impl Reason {
    pub fn words(self) -> &'static str {
        match self {
            Reason::NonVision => "this model cannot see images",
            Reason::AgedOut => "an older tool result",
            Reason::Capped => "over this request's image limit",
            Reason::Deduped => "the same image as earlier in this conversation",
            Reason::CannotTake => "this model cannot take it",
            Reason::AsText => "an image written as text where no image can be sent",
        }
    }
}

/// The text that takes an image's place: `sha256:` and 12 hex digits, what
/// the image was, and either its description or why it is not shown. The
/// same image always gives the same text (provider prompt caches keep
/// hitting).
pub fn placeholder(img: &Found, description: Option<&str>, reason: Reason) -> String {
    let text = match (&img.medium, description) {
        // The text the edge wrote for a document or audio, as it is.
        (Medium::Document { .. } | Medium::Audio { .. }, Some(text))
            if reason != Reason::Deduped =>
        {
            return text.to_owned();
        }
        _ => image_text(img, description, reason),
    };
    // One line, so it stays visor's own on a second pass: a line break in
    // a description, a file id or a declared media type becomes a space.
    match text.contains(['\n', '\r']) {
        true => text.replace(['\n', '\r'], " "),
        false => text,
    }
}

fn image_text(img: &Found, description: Option<&str>, reason: Reason) -> String {
    let short = short(&img.sha256);
    let noun = img.medium.label();
    if reason == Reason::Deduped {
        return format!("[{noun} sha256:{short}: the same {noun} as earlier in this conversation]");
    }
    let name = match &img.medium {
        Medium::Document { name: Some(n), .. } => format!(", {}", one_line(n)),
        _ => String::new(),
    };
    let what = match &img.source {
        Source::Encoded { media_type } => format!("{noun} sha256:{short}, {media_type}{name}"),
        Source::Inline {
            media_type, dims, ..
        } => match dims {
            Some((w, h)) if img.medium == Medium::Image => {
                format!("{noun} sha256:{short}, {media_type} {w}x{h}")
            }
            _ => format!("{noun} sha256:{short}, {media_type}{name}"),
        },
        // An empty URL has nothing to show (and would leave two spaces).
        Source::Url(url) if url.trim().is_empty() => {
            format!("{noun} sha256:{short}, an empty URL{name}")
        }
        Source::Url(url) if keepable(url) => {
            format!("{noun} {} (sha256:{short}){name}", url.trim())
        }
        Source::Url(url) => format!("{noun} sha256:{short}, a {}-character URL{name}", url.len()),
        Source::File(id) => format!("{noun} file {id} (sha256:{short}){name}"),
        Source::Broken(why) => {
            return format!("[{noun} sha256:{short} removed: {why}]");
        }
    };
    let why = match (&img.medium, reason) {
        (Medium::Document { .. }, Reason::CannotTake) => "this model cannot read documents",
        (Medium::Audio { .. }, Reason::CannotTake) => "this model cannot take audio",
        _ => reason.words(),
    };
    match description {
        Some(d) => format!("[{what}, described: {d}]"),
        None => format!("[{what}: not shown, {why}]"),
    }
}

fn short(sha256: &str) -> &str {
    sha256.get(..12).unwrap_or(sha256)
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// The head of the text that replaces a document: its `sha256:`, media
/// type, page count and name (one line; the pages follow).
pub fn document_header(
    sha256: &str,
    media_type: &str,
    name: Option<&str>,
    pages: usize,
    unit: &str,
) -> String {
    let s = if pages == 1 { "" } else { "s" };
    let name = name
        .map(|n| format!(", {}", one_line(n)))
        .unwrap_or_default();
    format!(
        "[document sha256:{}, {media_type}, {pages} {unit}{s}{name}]",
        short(sha256)
    )
}

/// The one line that replaces a document or audio visor could not turn
/// into text, saying why (`could not be read: encrypted`, `transcriber
/// unavailable`).
pub fn unreadable(
    noun: &str,
    sha256: &str,
    media_type: &str,
    name: Option<&str>,
    why: &str,
) -> String {
    let name = name
        .map(|n| format!(", {}", one_line(n)))
        .unwrap_or_default();
    format!(
        "[{noun} sha256:{}, {media_type}{name}: {}]",
        short(sha256),
        one_line(why)
    )
}

/// The one line that replaces audio: its `sha256:` and its transcript.
pub fn audio_text(sha256: &str, media_type: &str, transcript: &str) -> String {
    format!(
        "[audio sha256:{}, {media_type}, transcript: {}]",
        short(sha256),
        one_line(transcript.trim())
    )
}

/// Whether a URL is kept in the text that replaces its image: not when it
/// is long or carries inline data (the text would then hold the image it
/// replaces, or be found again as one), nor when it holds a control
/// character (a line break would split visor's one-line text).
pub(super) fn keepable(url: &str) -> bool {
    url.len() <= 2048
        && !url.contains("data:")
        && !url.contains("base64,")
        && !url.contains(char::is_control)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(source: Source) -> Found {
        Found {
            sha256: "7e272b7c6a81".repeat(5),
            source,
            message: 0,
            role: "user".to_owned(),
            in_tool_result: false,
            hoistable: false,
            path: String::new(),
            site: Site::Part(0..0),
            unit: 0,
            bytes: None,
            pending: None,
            encoded_at: None,
            markers: Vec::new(),
            medium: Medium::Image,
        }
    }

    #[test]
    fn an_image_text_is_one_line_that_says_why() {
        let url = |u: &str| found(Source::Url(u.to_owned()));
        let shown = placeholder(&url("https://example.com/a.png"), None, Reason::NonVision);
        assert_eq!(
            shown,
            "[image https://example.com/a.png (sha256:7e272b7c6a81): not shown, this model cannot see images]"
        );
        // A URL that would break the line, or carries the image itself, is
        // not shown: its length is.
        for odd in [
            "https://example.com/a.png?\nx",
            "data:image/png;base64,AAAA",
        ] {
            let t = placeholder(&url(odd), None, Reason::NonVision);
            assert!(
                t.starts_with("[image sha256:7e272b7c6a81, a ") && !t.contains(odd),
                "{t}"
            );
        }
        // An empty (or blank) URL: no double space, no blank where the URL
        // would be.
        for blank in ["", " ", "\t"] {
            let t = placeholder(&url(blank), None, Reason::NonVision);
            assert_eq!(
                t,
                "[image sha256:7e272b7c6a81, an empty URL: not shown, this model cannot see images]"
            );
        }
        let inline = found(Source::Inline {
            media_type: "image/png".to_owned(),
            size: 9,
            dims: Some((320, 200)),
        });
        let described = placeholder(&inline, Some("a chart\r\nwith two bars"), Reason::NonVision);
        assert_eq!(
            described,
            "[image sha256:7e272b7c6a81, image/png 320x200, described: a chart  with two bars]"
        );
        let file = placeholder(
            &found(Source::File("file\nid".to_owned())),
            None,
            Reason::Capped,
        );
        assert!(file.starts_with("[image file file id (sha256:"), "{file}");
        for t in [shown, described, file] {
            assert!(!t.contains('\n') && t.starts_with("[image ") && t.ends_with(']'));
        }
    }
}
