//! Replaced images, saved content-addressed so nothing is lost: the decoded
//! bytes of each image live at `<artifacts_dir>/<sha256 hex>`, written once
//! (temp file + rename, so a reader never sees half a file), and are served
//! back at `GET /visor/artifacts/<sha256 hex>` with the media type read from
//! their first bytes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// One image to save: the full SHA-256 hex of `bytes` and the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    pub sha256: String,
    pub bytes: bytes::Bytes,
}

#[derive(Debug, Clone)]
pub struct Artifacts {
    dir: PathBuf,
}

impl Artifacts {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Saves each artifact that is not on disk yet; returns how many were
    /// written. Content addressing makes an existing file the same bytes, so
    /// it is never rewritten (renaming over a big file is the slow part).
    pub fn save_all(&self, items: &[Artifact]) -> std::io::Result<usize> {
        let mut written = 0;
        let mut made_dir = false;
        for a in items {
            if !valid_id(&a.sha256) {
                continue;
            }
            let path = self.dir.join(&a.sha256);
            if path.exists() {
                continue;
            }
            if !made_dir {
                std::fs::create_dir_all(&self.dir)?;
                made_dir = true;
            }
            write_atomic(&path, &a.bytes)?;
            written += 1;
        }
        Ok(written)
    }

    /// The bytes and media type of a saved image; `None` when unknown. The
    /// id must be [`valid_id`], so the path never leaves the folder.
    pub fn read(&self, id: &str) -> std::io::Result<Option<(Vec<u8>, &'static str)>> {
        if !valid_id(id) {
            return Ok(None);
        }
        match std::fs::read(self.dir.join(id)) {
            Ok(bytes) => {
                let mt = sniff_media_type(&bytes).unwrap_or("application/octet-stream");
                Ok(Some((bytes, mt)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// How many hex digits of an artifact's SHA-256 the model sees
/// (`sha256:7ae32ec79dcb`).
pub const SHORT_ID: usize = 12;

/// What a short id names among the saved artifacts.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    /// Exactly one: its full id.
    One(String),
    None,
    /// Several (the model's 12 digits do not tell them apart).
    Many(usize),
}

impl Artifacts {
    /// The saved artifact whose id begins with `short` ([`SHORT_ID`]
    /// lower-case hex digits), when there is one.
    pub fn find(&self, short: &str) -> std::io::Result<Found> {
        if !is_short_id(short) {
            return Ok(Found::None);
        }
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::None),
            Err(e) => return Err(e),
        };
        let mut found = Vec::new();
        for entry in entries {
            let name = entry?.file_name();
            if let Some(name) = name.to_str()
                && valid_id(name)
                && name.starts_with(short)
            {
                found.push(name.to_owned());
            }
        }
        Ok(match found.len() {
            0 => Found::None,
            1 => Found::One(found.remove(0)),
            n => Found::Many(n),
        })
    }
}

/// [`SHORT_ID`] characters of `[0-9a-f]`.
pub fn is_short_id(id: &str) -> bool {
    id.len() == SHORT_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A full SHA-256 in lower-case hex: 64 characters of `[0-9a-f]`.
pub fn valid_id(id: &str) -> bool {
    id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Writes `bytes` to `path` through a temp file in the same folder and a
/// rename, so the file appears whole or not at all.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The media type of an image, read from its first bytes.
pub fn sniff_media_type(bytes: &[u8]) -> Option<&'static str> {
    use imagesize::ImageType;
    let head = &bytes[..bytes.len().min(64)];
    // Documents and audio first (a zip or a RIFF file is no image).
    if head.starts_with(b"%PDF-") {
        return Some("application/pdf");
    }
    if head.len() >= 12 && head.starts_with(b"RIFF") && &head[8..12] == b"WAVE" {
        return Some("audio/wav");
    }
    if head.starts_with(b"ID3") || (head.len() >= 2 && head[0] == 0xff && head[1] & 0xe0 == 0xe0) {
        return Some("audio/mpeg");
    }
    if head.starts_with(b"OggS") {
        return Some("audio/ogg");
    }
    if head.starts_with(b"fLaC") {
        return Some("audio/flac");
    }
    if let Ok(t) = imagesize::image_type(head) {
        return Some(match t {
            ImageType::Png => "image/png",
            ImageType::Jpeg => "image/jpeg",
            ImageType::Gif => "image/gif",
            ImageType::Webp => "image/webp",
            ImageType::Bmp => "image/bmp",
            ImageType::Tiff => "image/tiff",
            ImageType::Heif(imagesize::Compression::Av1) => "image/avif",
            ImageType::Heif(_) => "image/heif",
            _ => "application/octet-stream",
        });
    }
    let text = std::str::from_utf8(&bytes[..bytes.len().min(256)]).ok()?;
    let t = text.trim_start();
    (t.starts_with("<svg") || (t.starts_with("<?xml") && t.contains("<svg")))
        .then_some("image/svg+xml")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_64_lower_hex() {
        assert!(valid_id(&"a".repeat(64)));
        assert!(!valid_id(&"A".repeat(64)));
        assert!(!valid_id(&"a".repeat(63)));
        assert!(!valid_id("../../../../etc/passwd"));
        assert!(!valid_id(&format!("{}/..", "a".repeat(61))));
    }

    #[test]
    fn saves_once_and_reads_back_with_media_type() {
        let dir = std::env::temp_dir().join(format!("visor-art-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = Artifacts::new(dir.clone());
        let png = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/chart.png"
        ))
        .unwrap();
        let a = Artifact {
            sha256: "0".repeat(64),
            bytes: png.clone().into(),
        };
        assert_eq!(store.save_all(&[a.clone(), a.clone()]).unwrap(), 1);
        assert_eq!(store.save_all(&[a]).unwrap(), 0);
        let (bytes, mt) = store.read(&"0".repeat(64)).unwrap().unwrap();
        assert_eq!((bytes, mt), (png.clone(), "image/png"));
        assert!(store.read(&"1".repeat(64)).unwrap().is_none());
        assert!(store.read("..").unwrap().is_none());
        // The 12 digits the model sees find it; a prefix of two does not.
        assert_eq!(
            store.find(&"0".repeat(12)).unwrap(),
            Found::One("0".repeat(64))
        );
        assert_eq!(store.find(&"1".repeat(12)).unwrap(), Found::None);
        assert_eq!(store.find("../../etc/pa").unwrap(), Found::None);
        let mut b = "0".repeat(63);
        b.push('1');
        let other = Artifact {
            sha256: b,
            bytes: png.clone().into(),
        };
        store.save_all(&[other]).unwrap();
        assert_eq!(store.find(&"0".repeat(12)).unwrap(), Found::Many(2));
        std::fs::remove_file(dir.join(format!("{}1", "0".repeat(63)))).unwrap();
        // No temp files are left behind.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(names.len(), 1);
        let _ = std::fs::remove_dir_all(dir);
    }
}
