//! Tidy rules checked over the workspace's Rust sources (as `cargo test` runs):
//! - no source file of a library or binary crate (`compiler/`, `runtime/`, `kernels/`,
//!   `format/`, `cli/`, `macros/`; their `tests/` folders aside) over 700 lines;
//! - no function there, nor in the test support crate (`tests/src`), over 200 lines;
//! - every kernel entry name written as a string literal at most once in all Rust sources
//!   (its declaration in the kernels crate);
//! - every `unsafe` block, function or impl has a `// SAFETY:` comment just above it;
//! - no tensor name a phase signature declares written as a string literal in the crates'
//!   sources (`src/` of the library and binary crates, the Python extension and the test
//!   support crate): they are spelled once, in `kernels/src/io.rs`, and declared once, in
//!   `format/src/signature.rs`. A line that means the same word as something else (the
//!   `outputs` flag's spelling "logits") says so with `tidy: not a tensor name`.

use std::path::{Path, PathBuf};

use specplan_format::Entry;

const LIB_DIRS: [&str; 6] = ["compiler", "runtime", "kernels", "format", "cli", "macros"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

fn is_lib_source(p: &Path) -> bool {
    let rel = p.strip_prefix(root()).unwrap_or(p);
    let parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    parts.first().is_some_and(|f| LIB_DIRS.contains(&f.as_str())) && !parts.iter().any(|c| c == "tests")
}

fn all_files() -> Vec<PathBuf> {
    let mut v = Vec::new();
    rust_files(&root(), &mut v);
    v.sort();
    v
}

/// Functions of `lines` (rustfmt'd code from `f`) over 200 lines: a function starts at `fn`
/// and ends at the first `}` at its indent.
fn long_functions(f: &Path, lines: &[&str]) -> Vec<String> {
    let mut bad = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let is_fn = [
            "fn ",
            "pub fn ",
            "pub(crate) fn ",
            "pub(super) fn ",
            "const fn ",
            "pub const fn ",
            "unsafe fn ",
        ]
        .iter()
        .any(|p| t.starts_with(p));
        if !is_fn || t.ends_with(';') {
            continue;
        }
        let indent = l.len() - t.len();
        let close = format!("{}}}", " ".repeat(indent));
        if let Some(len) = lines[i..].iter().position(|x| *x == close) {
            if len > 200 {
                bad.push(format!("{}:{}: a function of {len} lines (> 200)", f.display(), i + 1));
            }
        }
    }
    bad
}

#[test]
fn library_files_and_functions_stay_small() {
    let mut bad = Vec::new();
    for f in all_files().into_iter().filter(|f| is_lib_source(f)) {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        if lines.len() > 700 {
            bad.push(format!("{}: {} lines (> 700)", f.display(), lines.len()));
        }
        bad.extend(long_functions(&f, &lines));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The test support crate's checks and GPU binaries (`tests/src`) keep the same function
/// bound: they run only on the GPU machine, where a long function is the hardest to debug.
#[test]
fn harness_functions_stay_small() {
    let harness = root().join("tests").join("src");
    let mut bad = Vec::new();
    for f in all_files().into_iter().filter(|f| f.starts_with(&harness)) {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        bad.extend(long_functions(&f, &lines));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn every_entry_name_is_written_once() {
    let mut bad = Vec::new();
    let files: Vec<(PathBuf, String)> = all_files()
        .into_iter()
        .map(|f| {
            let t = std::fs::read_to_string(&f).unwrap_or_default();
            (f, t)
        })
        .collect();
    for e in Entry::ALL {
        let lit = format!("\"{}\"", e.name());
        let at: Vec<String> = files
            .iter()
            .flat_map(|(f, t)| {
                t.lines()
                    .enumerate()
                    .filter(|(_, l)| l.contains(&lit))
                    .map(move |(i, _)| format!("{}:{}", f.display(), i + 1))
            })
            .collect();
        if at.len() > 1 {
            bad.push(format!("{lit} is written {} times: {}", at.len(), at.join(", ")));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn every_unsafe_has_a_safety_comment() {
    let mut bad = Vec::new();
    // This file names the patterns it looks for.
    for f in all_files().into_iter().filter(|f| !f.ends_with("tests/tidy.rs")) {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let code = l.split("//").next().unwrap_or("");
            let uses = code.contains("unsafe {") || code.contains("unsafe fn") || code.contains("unsafe impl");
            if !uses || code.trim_start().starts_with("#[") {
                continue;
            }
            let window = &lines[i.saturating_sub(8)..=i];
            if !window.iter().any(|x| x.contains("SAFETY:")) {
                bad.push(format!(
                    "{}:{}: unsafe without a // SAFETY: comment above",
                    f.display(),
                    i + 1
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn tensor_names_are_spelled_only_in_the_signature() {
    let names: Vec<String> = specplan_format::signature::all_names()
        .map(|n| format!("\"{n}\""))
        .collect();
    assert!(names.len() >= 12, "the signature declares its tensors: {names:?}");
    let in_scope = |p: &Path| {
        let rel = p.strip_prefix(root()).unwrap_or(p).to_string_lossy().replace('\\', "/");
        let src = LIB_DIRS.iter().any(|d| rel.starts_with(&format!("{d}/")))
            || rel.starts_with("python/src/")
            || rel.starts_with("tests/src/");
        src && !rel.contains("/tests/") && !rel.starts_with("kernels/derive/") && rel != "kernels/src/io.rs"
    };
    let mut bad = Vec::new();
    for f in all_files().into_iter().filter(|f| in_scope(f)) {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") || line.contains("tidy: not a tensor name") {
                continue;
            }
            if let Some(n) = names.iter().find(|n| line.contains(n.as_str())) {
                bad.push(format!("{}:{}: {n} (use specplan_format::io)", f.display(), i + 1));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "tensor names outside the signature:\n{}",
        bad.join("\n")
    );
}
