//! `[inspector]`: the page at `/visor/ui` and the JSON at `/visor/api/…`
//! that show what visor did to recent requests — whether it is on, how many
//! requests and how many bytes of their bodies it keeps, and the keys that
//! may open it.

use serde::Deserialize;

use super::{Problems, Secret};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawInspector {
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    #[serde(default = "default_keep")]
    pub keep: usize,
    #[serde(default = "default_body_bytes")]
    pub body_bytes: usize,
    #[serde(default)]
    pub admin_keys: Vec<Secret>,
}

impl Default for RawInspector {
    fn default() -> Self {
        Self {
            enabled: default_enabled(),
            keep: default_keep(),
            body_bytes: default_body_bytes(),
            admin_keys: Vec::new(),
        }
    }
}

fn default_enabled() -> bool {
    true
}
fn default_keep() -> usize {
    1000
}
fn default_body_bytes() -> usize {
    64 * 1024 * 1024
}

/// The most request summaries one replica keeps.
pub const MAX_KEEP: usize = 100_000;

/// `[inspector]`, checked.
#[derive(Debug, Clone)]
pub struct Inspector {
    pub enabled: bool,
    /// Request summaries kept, newest first (1 to [`MAX_KEEP`]).
    pub keep: usize,
    /// Bytes of the newest requests' bodies kept (as the inspector keeps
    /// them: without image or document bytes); 0 keeps none.
    pub body_bytes: usize,
    /// Keys that open the inspector (never a proxy key).
    pub admin_keys: Vec<Secret>,
}

impl RawInspector {
    pub(super) fn validate(self, p: &mut Problems) -> Inspector {
        if self.keep == 0 || self.keep > MAX_KEEP {
            p.bad(
                "inspector.keep",
                self.keep,
                format_args!("must be 1 to {MAX_KEEP}"),
            );
        }
        for (i, k) in self.admin_keys.iter().enumerate() {
            if k.expose().trim().is_empty() {
                p.bad(
                    format_args!("inspector.admin_keys[{i}]"),
                    "\"\"",
                    "empty; an admin key must be a secret",
                );
            }
        }
        Inspector {
            enabled: self.enabled,
            keep: self.keep.clamp(1, MAX_KEEP),
            body_bytes: self.body_bytes,
            admin_keys: self.admin_keys,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{load, problems, ups};

    #[test]
    fn on_by_default_keeping_a_thousand() {
        let c = load(&ups(&[("a", "")])).unwrap().inspector;
        assert!(c.enabled && c.keep == 1000 && c.admin_keys.is_empty());
        assert_eq!(c.body_bytes, 64 << 20);
    }

    #[test]
    fn keep_is_bounded_and_admin_keys_are_not_empty() {
        let p = problems(&format!(
            "{}[inspector]\nkeep = 0\nadmin_keys = [\"\"]\n",
            ups(&[("a", "")])
        ));
        assert!(p.contains("inspector.keep: 0"), "{p}");
        assert!(p.contains("inspector.admin_keys[0]"), "{p}");
    }
}
