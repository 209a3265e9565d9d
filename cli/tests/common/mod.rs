//! Helpers shared by the CLI's integration tests. Every special file (FIFO, link,
//! read-only file) is made inside a fresh temporary directory, never elsewhere.
#![allow(dead_code)]

use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn specplan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_specplan"))
        .args(args)
        .output()
        .expect("run specplan")
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Asserts exit code 2 and that stderr says `what` once, on one `error:` line.
pub fn assert_refused(o: &Output, what: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{}", text(o));
    assert_eq!(err.matches(what).count(), 1, "expected {what:?} once in:\n{err}");
    assert_eq!(err.lines().filter(|l| l.starts_with("error: ")).count(), 1, "{err}");
}

/// Compiles `tiny` (no kernels) to `out` with extra flags; panics unless it succeeds.
pub fn compile_tiny(out: &Path, extra: &[&str]) {
    let out_s = s(out);
    let mut args = vec!["compile", "--no-kernels", "--preset", "tiny", "-o", &out_s];
    args.extend_from_slice(extra);
    let o = specplan(&args);
    assert!(o.status.success(), "{}", text(&o));
}

/// The names in `dir`, sorted (temporary files would show up here).
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

pub fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().expect("run mkfifo");
    assert!(st.success(), "mkfifo {}", p.display());
}

pub fn is_fifo(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_fifo())
}

/// Reads everything written into the FIFO at `p`, on a thread (opening a FIFO blocks until
/// a writer opens it). Call [`FifoReader::finish`] after the writer has exited.
pub struct FifoReader {
    path: PathBuf,
    handle: std::thread::JoinHandle<Vec<u8>>,
}

impl FifoReader {
    pub fn start(path: &Path) -> FifoReader {
        let p = path.to_path_buf();
        let handle = std::thread::spawn(move || {
            use std::io::Read as _;
            let mut f = std::fs::File::open(&p).expect("open fifo for reading");
            let mut v = Vec::new();
            f.read_to_end(&mut v).expect("read fifo");
            v
        });
        FifoReader {
            path: path.to_path_buf(),
            handle,
        }
    }

    /// What the writer wrote. If the writer never opened the FIFO, the reader is still
    /// blocked in `open`: opening the write end without blocking releases it (EOF).
    pub fn finish(self) -> Vec<u8> {
        const O_NONBLOCK: i32 = 0o4000; // Linux, x86_64 and aarch64.
        for _ in 0..100 {
            if self.handle.is_finished() {
                break;
            }
            match std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(O_NONBLOCK)
                .open(&self.path)
            {
                Ok(w) => {
                    drop(w);
                    break;
                }
                // No reader yet (the thread has not reached `open`): try again.
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
        self.handle.join().expect("fifo reader")
    }
}
