//! Output paths (issue 14, class 4): every file `specplan` writes is written atomically or
//! through, and never replaces a FIFO, a link, a read-only file, a directory or one of the
//! command's inputs; a refused or failed command leaves nothing behind; a closed standard
//! output ends a command quietly. Special files live only in a fresh temporary directory.

mod common;

use std::io::Read as _;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;

#[test]
fn a_fifo_is_written_through_never_replaced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reference = dir.path().join("ref.plan");
    compile_tiny(&reference, &[]);
    let fifo = dir.path().join("pipe");
    mkfifo(&fifo);
    let reader = FifoReader::start(&fifo);
    let o = specplan(&["compile", "--no-kernels", "--preset", "tiny", "-o", &s(&fifo)]);
    let got = reader.finish();
    assert!(o.status.success(), "{}", text(&o));
    assert!(is_fifo(&fifo), "the FIFO was replaced");
    assert_eq!(got, std::fs::read(&reference).expect("read"), "streamed bytes differ");
    assert_eq!(names(dir.path()), ["pipe", "ref.plan"]);

    // Through a link to the FIFO (as `-o /dev/stdout` is a link to a pipe): both stay.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink("pipe", &link).expect("symlink");
    let reader = FifoReader::start(&fifo);
    let o = specplan(&["compile", "--no-kernels", "--preset", "tiny", "-o", &s(&link)]);
    let got = reader.finish();
    assert!(o.status.success(), "{}", text(&o));
    assert!(is_fifo(&fifo), "the FIFO was replaced");
    assert_eq!(std::fs::read_link(&link).expect("readlink"), Path::new("pipe"));
    assert_eq!(got, std::fs::read(&reference).expect("read"), "streamed bytes differ");
    assert_eq!(names(dir.path()), ["link", "pipe", "ref.plan"]);
}

/// A FIFO with no reader blocks its writer (as `cat > fifo` does). Streams are written
/// before any file is staged, so a command killed while it waits leaves nothing behind:
/// no plan without its text, no temporary file.
#[test]
fn a_command_killed_while_a_fifo_waits_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("a.plan");
    let fifo = dir.path().join("a.plan.txt");
    mkfifo(&fifo);
    let mut child = Command::new(env!("CARGO_BIN_EXE_specplan"))
        .args(["compile", "--no-kernels", "--preset", "tiny", "--text", "-o", &s(&plan)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run specplan");
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(
        child.try_wait().expect("wait").is_none(),
        "the writer should be waiting for a reader"
    );
    child.kill().expect("kill");
    child.wait().expect("reap");
    assert!(is_fifo(&fifo), "the FIFO was replaced");
    assert_eq!(
        names(dir.path()),
        ["a.plan.txt"],
        "a plan without its text, or a temporary file, was left"
    );
}

#[test]
fn a_symlink_is_followed_and_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("target.plan");
    std::fs::write(&target, b"old").expect("write");
    let link = dir.path().join("link.plan");
    std::os::unix::fs::symlink("target.plan", &link).expect("symlink");
    compile_tiny(&link, &[]);
    let meta = std::fs::symlink_metadata(&link).expect("lstat");
    assert!(meta.file_type().is_symlink(), "the link was replaced");
    assert_eq!(std::fs::read_link(&link).expect("readlink"), Path::new("target.plan"));
    let bytes = std::fs::read(&target).expect("read");
    assert!(
        specplan_format::decode(&bytes).is_ok(),
        "the link's target holds no plan"
    );
    assert_eq!(names(dir.path()), ["link.plan", "target.plan"]);

    // A link to nothing is refused, and stays as it was.
    let dangling = dir.path().join("dangling.plan");
    std::os::unix::fs::symlink("nowhere/x.plan", &dangling).expect("symlink");
    let o = specplan(&["compile", "--no-kernels", "--preset", "tiny", "-o", &s(&dangling)]);
    assert_refused(&o, "symbolic link to nowhere/x.plan");
    assert_eq!(
        std::fs::read_link(&dangling).expect("readlink"),
        Path::new("nowhere/x.plan")
    );
    assert_eq!(names(dir.path()), ["dangling.plan", "link.plan", "target.plan"]);
}

#[test]
fn a_read_only_file_is_refused_and_unchanged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ro = dir.path().join("ro.plan");
    std::fs::write(&ro, b"keep me").expect("write");
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).expect("chmod");
    let o = specplan(&["compile", "--no-kernels", "--preset", "tiny", "-o", &s(&ro)]);
    assert_refused(&o, "it is read-only (mode 444)");
    assert_eq!(std::fs::read(&ro).expect("read"), b"keep me");
    let mode = std::fs::metadata(&ro).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode, 0o444);
    assert_eq!(names(dir.path()), ["ro.plan"]);
}

#[test]
fn an_existing_file_is_replaced_atomically_keeping_its_mode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("p.plan");
    std::fs::write(&p, b"old").expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    compile_tiny(&p, &["--text"]);
    assert!(specplan_format::decode(&std::fs::read(&p).expect("read")).is_ok());
    let mode = std::fs::metadata(&p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the replaced file's mode changed");
    let text_mode = std::fs::metadata(dir.path().join("p.plan.txt"))
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(text_mode, 0o644);
    assert_eq!(names(dir.path()), ["p.plan", "p.plan.txt"]);
}

#[test]
fn a_directory_is_refused_before_any_work_and_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().join("d");
    std::fs::create_dir(&d).expect("mkdir");
    let o = specplan(&["compile", "--no-kernels", "--preset", "tiny", "--text", "-o", &s(&d)]);
    assert_refused(&o, "it is a directory");
    assert_eq!(names(dir.path()), ["d"], "DIR.txt or a temporary file was left behind");
    assert!(names(&d).is_empty());

    // The text path a directory: refused before the plan is written.
    let p = dir.path().join("p.plan");
    std::fs::create_dir(dir.path().join("p.plan.txt")).expect("mkdir");
    let o = specplan(&["compile", "--no-kernels", "--preset", "tiny", "--text", "-o", &s(&p)]);
    assert_refused(&o, "p.plan.txt: it is a directory");
    assert_eq!(names(dir.path()), ["d", "p.plan.txt"]);

    // A directory that does not exist: refused by the check, before any work; nothing
    // created anywhere.
    let o = specplan(&[
        "compile",
        "--no-kernels",
        "--preset",
        "tiny",
        "-o",
        &s(&dir.path().join("missing/p.plan")),
    ]);
    assert_refused(&o, "its folder");
    assert_eq!(names(dir.path()), ["d", "p.plan.txt"]);
}

#[test]
fn an_output_equal_to_an_input_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("c.toml");
    let toml = include_str!("../../compiler/presets/tiny.toml");
    std::fs::write(&cfg, toml).expect("write");
    let o = specplan(&["compile", "--no-kernels", "--config", &s(&cfg), "-o", &s(&cfg)]);
    assert_refused(&o, "is the same file as the input --config");
    // The same file through a link and through a hard link.
    let link = dir.path().join("link.plan");
    std::os::unix::fs::symlink(&cfg, &link).expect("symlink");
    let o = specplan(&["compile", "--no-kernels", "--config", &s(&cfg), "-o", &s(&link)]);
    assert_refused(&o, "is the same file as the input --config");
    let hard = dir.path().join("hard.plan");
    std::fs::hard_link(&cfg, &hard).expect("link");
    let o = specplan(&["compile", "--no-kernels", "--config", &s(&cfg), "-o", &s(&hard)]);
    assert_refused(&o, "is the same file as the input --config");
    // --text's file is an output too: the config named like the plan's text.
    let named = dir.path().join("p.plan.txt");
    std::fs::write(&named, toml).expect("write");
    let o = specplan(&[
        "compile",
        "--no-kernels",
        "--config",
        &s(&named),
        "--text",
        "-o",
        &s(&dir.path().join("p.plan")),
    ]);
    assert_refused(&o, "is the same file as the input --config");
    assert_eq!(std::fs::read_to_string(&named).expect("read"), toml);
    assert_eq!(std::fs::read_to_string(&cfg).expect("read"), toml);
    assert_eq!(names(dir.path()), ["c.toml", "hard.plan", "link.plan", "p.plan.txt"]);
}

/// Runs `specplan args` with its standard output closed before it writes, and returns
/// its exit status and standard error.
fn with_closed_stdout(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_specplan"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn specplan");
    // The reader leaves at once, as `| head -1` does after its line or `| true` at once.
    drop(child.stdout.take());
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err).expect("read stderr");
    }
    (child.wait().expect("wait").code(), err)
}

#[test]
fn a_closed_stdout_ends_quietly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("p.plan");
    // `compile ... | true`: the plan is written, the summary has no reader.
    let (code, err) = with_closed_stdout(&["compile", "--no-kernels", "--preset", "tiny", "-o", &s(&p)]);
    assert_eq!((code, err.as_str()), (Some(0), ""));
    assert!(specplan_format::decode(&std::fs::read(&p).expect("read")).is_ok());
    // `show p.plan | head -1`, `dot`, `graph`, `presets`.
    for args in [
        vec!["show", &s(&p)],
        vec!["dot", &s(&p)],
        vec!["graph", "--preset", "tiny"],
        vec!["presets"],
    ] {
        let args: Vec<&str> = args.iter().map(|a| a.as_ref()).collect();
        let (code, err) = with_closed_stdout(&args);
        assert_eq!((code, err.as_str()), (Some(0), ""), "{args:?}");
    }
    // `diff` keeps its verdict: 1 for different plans, even when nobody reads the listing.
    let q = dir.path().join("q.plan");
    compile_tiny(&q, &["--sliding-window", "8"]);
    let (code, err) = with_closed_stdout(&["diff", &s(&p), &s(&q)]);
    assert_eq!((code, err.as_str()), (Some(1), ""));
    // A real error still reports.
    let (code, err) = with_closed_stdout(&["show", &s(&dir.path().join("none.plan"))]);
    assert_eq!(code, Some(2));
    assert!(err.starts_with("error: cannot load plan"), "{err}");
}

#[test]
fn config_errors_come_before_nvrtc_and_outputs_before_configs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("p.plan");
    // Without --no-kernels: a bad bucket list is reported whether NVRTC is there or not.
    let o = specplan(&["compile", "--preset", "tiny", "--buckets", "8,4,2", "-o", &s(&p)]);
    assert_refused(
        &o,
        "capture.buckets (--buckets): \"8,4,2\": 4 is below the bucket before it (8)",
    );
    assert!(!text(&o).contains("NVRTC"), "{}", text(&o));
    // A refused output is reported before the config is even read.
    let o = specplan(&[
        "compile",
        "--config",
        &s(&dir.path().join("missing.toml")),
        "-o",
        &s(dir.path()),
    ]);
    assert_refused(&o, "it is a directory");
    assert!(names(dir.path()).is_empty());
}
