//! `[dedup]`: repeated runs of lines (a file read twice, a log pasted
//! again) replaced by a note.

use serde::Deserialize;

use super::Problems;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDedup {
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// A repeated run of lines is replaced by a note when it has at least
    /// this many lines…
    #[serde(default = "default_min_run_lines")]
    pub min_run_lines: u32,
    /// …and this many bytes (chosen on the real-traffic corpus: docs/dedup.md).
    #[serde(default = "default_min_run_bytes")]
    pub min_run_bytes: u32,
    /// Memory for what dedup read of each conversation, kept so its next
    /// request reads only its new messages (0: every request is read in
    /// full).
    #[serde(default = "default_state_bytes")]
    pub state_bytes: u64,
    /// The line dedup of earlier versions; accepted and ignored, with a
    /// warning (see [`super::Config::warnings`]).
    #[serde(default)]
    pub min_line_chars: Option<u32>,
}

impl Default for RawDedup {
    fn default() -> Self {
        Self {
            enabled: true,
            min_run_lines: default_min_run_lines(),
            min_run_bytes: default_min_run_bytes(),
            state_bytes: default_state_bytes(),
            min_line_chars: None,
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_min_run_lines() -> u32 {
    2
}
fn default_min_run_bytes() -> u32 {
    64
}
fn default_state_bytes() -> u64 {
    128 << 20
}

/// `[dedup]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dedup {
    pub enabled: bool,
    /// At least 2.
    pub min_run_lines: u32,
    pub min_run_bytes: u32,
    /// Bytes of conversations' dedup state kept (0: none).
    pub state_bytes: u64,
}

impl RawDedup {
    /// The section checked; `min_line_chars` adds a warning.
    pub(super) fn validate(self, p: &mut Problems, warnings: &mut Vec<String>) -> Dedup {
        if self.min_run_lines < 2 {
            p.bad(
                "dedup.min_run_lines",
                self.min_run_lines,
                "must be at least 2 (a single repeated line always stays)",
            );
        }
        if self.min_line_chars.is_some() {
            warnings.push(
                "dedup.min_line_chars: no longer used (dedup removes repeated runs of lines; see dedup.min_run_lines and dedup.min_run_bytes) — ignored"
                    .to_owned(),
            );
        }
        Dedup {
            enabled: self.enabled,
            min_run_lines: self.min_run_lines,
            min_run_bytes: self.min_run_bytes,
            state_bytes: self.state_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{load, problems};

    #[test]
    fn the_old_line_dedup_key_loads_with_a_warning_and_runs_are_checked() {
        let up = "[[upstream]]\nname=\"a\"\nbase_url=\"http://x/v1\"\n";
        let cfg = load(&format!("[dedup]\nmin_line_chars = 16\n{up}")).unwrap();
        assert_eq!(cfg.warnings.len(), 1);
        assert!(
            cfg.warnings[0].starts_with("dedup.min_line_chars"),
            "{:?}",
            cfg.warnings
        );
        assert_eq!((cfg.dedup.min_run_lines, cfg.dedup.min_run_bytes), (2, 64));
        assert!(load(up).unwrap().warnings.is_empty());
        let e = problems(&format!("[dedup]\nmin_run_lines = 1\n{up}"));
        assert!(
            e.contains("dedup.min_run_lines: 1 — must be at least 2"),
            "{e}"
        );
    }
}
