//! The README and the user documents under docs/: the README stays a front
//! door (at most 400 lines), every relative link and `#anchor` in them
//! resolves, and every TOML block that is a whole configuration (it holds an
//! `[[upstream]]`) passes `visor check`, and every `visor` command shown
//! runs as shown (its synopsis flags exist). No network.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

const README_MAX_LINES: usize = 400;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every docs/*.md, as (path, text).
fn documents() -> Vec<(PathBuf, String)> {
    let mut paths = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ holds no .md file");
    paths.extend(docs);
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect()
}

/// Lines outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let marker = if t.starts_with("```") {
            Some("```")
        } else if t.starts_with("~~~") {
            Some("~~~")
        } else {
            None
        };
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(f), Some(m)) if f == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// Fenced blocks as (info string, first line number, body).
fn fenced_blocks(text: &str) -> Vec<(String, usize, String)> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("```") {
            match open.take() {
                None => open = Some((rest.trim().to_lowercase(), i + 1, String::new())),
                Some(block) => out.push(block),
            }
        } else if let Some((_, _, body)) = open.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    assert!(open.is_none(), "a fenced code block is never closed");
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped (letters,
/// digits, `-`, `_` and spaces kept), spaces turned into `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a markdown file's headings make, duplicates numbered as
/// GitHub numbers them (`x`, `x-1`, `x-2`).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&line[hashes..]);
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// Inline links `[text](target)` outside code, as (line, target).
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose_lines(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push((n, target.to_string()));
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn readme_is_a_front_door() {
    let text = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = text.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, at most {README_MAX_LINES}: move the detail into docs/"
    );
}

#[test]
fn every_docs_page_is_linked_from_the_readme() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let linked: BTreeSet<String> = links(&readme)
        .into_iter()
        .map(|(_, t)| t.split('#').next().unwrap().to_string())
        .collect();
    for (path, _) in documents().iter().skip(1) {
        let name = format!("docs/{}", path.file_name().unwrap().to_string_lossy());
        assert!(linked.contains(&name), "README.md never links {name}");
    }
}

#[test]
fn relative_links_and_anchors_resolve() {
    let mut problems = Vec::new();
    let mut checked = 0;
    let mut anchor_cache: HashMap<PathBuf, BTreeSet<String>> = HashMap::new();
    for (path, text) in documents() {
        let dir = path.parent().unwrap().to_path_buf();
        let shown = path.strip_prefix(root()).unwrap().display().to_string();
        for (line, target) in links(&text) {
            if target.is_empty()
                || target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            checked += 1;
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let resolved = if file.is_empty() {
                path.clone()
            } else {
                dir.join(file)
            };
            if !resolved.exists() {
                problems.push(format!("{shown}:{line}: {target}: no such file"));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if resolved.extension().is_none_or(|x| x != "md") {
                continue;
            }
            let key = resolved.canonicalize().unwrap();
            let set = anchor_cache
                .entry(key.clone())
                .or_insert_with(|| anchors(&std::fs::read_to_string(&key).unwrap()));
            if !set.contains(anchor) {
                problems.push(format!(
                    "{shown}:{line}: {target}: no heading makes #{anchor}"
                ));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} relative links found: is the link reader broken?"
    );
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

/// `${VAR}` names in a config text.
fn env_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        let after = &rest[at + 2..];
        let Some(end) = after.find('}') else { break };
        out.insert(after[..end].to_string());
        rest = &after[end..];
    }
    out
}

fn check_config(name: &str, text: &str) -> (bool, String) {
    let tmp =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("docs-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let path = tmp.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_visor"));
    // A directory of its own, so a relative data_dir never meets a real store.
    c.current_dir(&tmp)
        .env_remove("VISOR_CONFIG")
        .args(["check", "--config"])
        .arg(&path);
    for var in env_refs(text) {
        c.env(var, "docs-test-value");
    }
    let out = c.output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn whole_configs_in_the_docs_pass_visor_check() {
    let mut checked = Vec::new();
    let mut failures = Vec::new();
    for (path, text) in documents() {
        let shown = path.strip_prefix(root()).unwrap().display().to_string();
        for (info, line, body) in fenced_blocks(&text) {
            if info.split_whitespace().next() != Some("toml") {
                continue;
            }
            // A fragment (one table, a client's own config) may be skipped
            // only when it names no upstream.
            if !body.contains("[[upstream]]") {
                continue;
            }
            let name = format!(
                "{}-{line}",
                Path::new(&shown).file_stem().unwrap().to_string_lossy()
            );
            let (ok, output) = check_config(&name, &body);
            checked.push(format!("{shown}:{line}"));
            if !ok {
                failures.push(format!("{shown}:{line}: visor check failed:\n{output}"));
            }
        }
    }
    assert!(
        !checked.is_empty(),
        "no whole config found in README.md or docs/"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    eprintln!(
        "checked {} whole configs: {}",
        checked.len(),
        checked.join(", ")
    );
}

/// A command shown: where (`page:line`), and its arguments after `visor`.
type Shown = (String, Vec<String>);

/// The `visor` commands the README and docs show in their code blocks
/// (`visor …`, `$ visor …`, `cargo run --release -- …`), without the
/// shell comment, and the synopsis lines (`visor check [--config PATH] …`).
fn shown_commands() -> (Vec<Shown>, Vec<(String, String)>) {
    let mut commands = Vec::new();
    let mut synopses = Vec::new();
    for (path, text) in documents() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        for (lang, line, body) in fenced_blocks(&text) {
            if !matches!(lang.as_str(), "" | "sh" | "shell" | "console" | "bash") {
                continue;
            }
            for (k, l) in body.lines().enumerate() {
                let l = l.trim().trim_start_matches("$ ");
                let rest = l
                    .strip_prefix("cargo run --release -- ")
                    .or_else(|| l.strip_prefix("visor "));
                let Some(rest) = rest else { continue };
                let rest = rest.split(" #").next().unwrap_or(rest).trim();
                let at = format!("{name}:{}", line + k + 1);
                if rest.contains('[') {
                    synopses.push((at, rest.to_owned()));
                } else {
                    commands.push((at, rest.split_whitespace().map(str::to_owned).collect()));
                }
            }
        }
    }
    (commands, synopses)
}

/// Every `visor` command shown runs as shown: `init` writes its recipe,
/// `check` (after it, with the recipe's variables set) passes, `serve` is
/// checked with the same config; a `--config` naming a file the page only
/// describes (`bad.toml`) is left out. Every flag a synopsis line shows is
/// one the command takes.
#[test]
fn the_visor_commands_shown_run() {
    let (commands, synopses) = shown_commands();
    assert!(
        commands.iter().any(|(_, c)| c[0] == "init"),
        "no `visor init` shown: {commands:?}"
    );
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("docs-commands-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let visor = |dir: &Path, args: &[String]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_visor"));
        c.current_dir(dir).env_remove("VISOR_CONFIG").args(args);
        for var in [
            "DEEPSEEK_API_KEY",
            "OPENAI_API_KEY",
            "AZURE_OPENAI_KEY",
            "TEAM_A_KEY",
            "TEAM_B_KEY",
        ] {
            c.env(var, "docs-test-value");
        }
        c.output().unwrap()
    };
    let mut ran = 0;
    for (at, args) in &commands {
        let config = args
            .iter()
            .position(|a| a == "--config")
            .and_then(|i| args.get(i + 1));
        if config.is_some_and(|c| !tmp.join(c).exists() && !root().join(c).exists()) {
            continue;
        }
        let args: Vec<String> = match args[0].as_str() {
            // The same config, checked (serving would not return).
            "serve" => std::iter::once("check".to_owned())
                .chain(
                    args[1..]
                        .chunks(2)
                        .filter(|p| p[0] == "--config")
                        .flatten()
                        .cloned(),
                )
                .collect(),
            "init" => {
                let mut a = args.clone();
                a.push("--force".to_owned());
                a
            }
            _ => args.clone(),
        };
        let out = visor(&tmp, &args);
        assert!(
            out.status.success(),
            "{at}: visor {}\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ran += 1;
    }
    assert!(ran >= 3, "{ran} commands ran of {commands:?}");
    for (at, line) in &synopses {
        let sub = line.split_whitespace().next().unwrap();
        let out = visor(&tmp, &[sub.to_owned(), "--help".to_owned()]);
        let help = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{at}: visor {sub} --help");
        for flag in line
            .split(|c: char| c.is_whitespace() || c == '[' || c == ']')
            .filter(|w| w.starts_with("--"))
        {
            assert!(
                help.contains(flag),
                "{at}: `visor {sub}` has no {flag}:\n{help}"
            );
        }
    }
}
