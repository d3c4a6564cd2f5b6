//! Names the commit visor is built from (`visor_build_info{commit}`):
//! `VISOR_COMMIT` when set (packagers), else `git rev-parse` of this
//! checkout, else `unknown` (a source copy without `.git`).

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=VISOR_COMMIT");
    // Built again when the checkout moves to another commit (only paths
    // that exist: a missing one would rebuild every time).
    for p in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        if Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    let commit = std::env::var("VISOR_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| {
            let out = Command::new("git")
                .args(["rev-parse", "--short=12", "HEAD"])
                .output()
                .ok()?;
            let c = String::from_utf8(out.stdout).ok()?;
            (out.status.success() && !c.trim().is_empty()).then(|| c.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=VISOR_COMMIT={commit}");
}
