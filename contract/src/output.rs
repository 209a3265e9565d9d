//! Output files that never clobber what they must not: the rules every file `specplan`
//! writes follows (the `run` outputs here; the CLI's plans and texts too).
//!
//! - A new path or an existing regular file is written atomically: a temporary file in the
//!   same directory, synced, then renamed into place (a new path is linked, so a file that
//!   appears meanwhile is not replaced). A reader sees the old file or the whole new one,
//!   and a failure leaves no temporary file behind.
//! - A FIFO or a character device (`/dev/null`, a terminal) is written through: opened
//!   for writing without truncating or creating, then streamed. It is never replaced.
//! - A symbolic link is followed: its target gets the rules above; the link stays. A link
//!   to nothing is refused.
//! - Refused, with the reason: a read-only file, a directory, a block device, a socket, a
//!   new path whose folder does not exist, and an output that is the same file (device and
//!   inode) as one of the command's inputs.
//! - A command with several outputs writes its streams first, before any temporary file
//!   exists (a FIFO without a reader blocks, and a stream cannot be taken back), then
//!   stages its files and puts them in place.
//!
//! [`check_output`] applies the rules before any work (so a doomed command fails at once);
//! [`OutputTarget::write`] re-checks the file type just before it writes.

use std::io::Write as _;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// An output that cannot be written, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot write {path}: {message}")]
pub struct OutputError {
    pub path: String,
    pub message: String,
}

/// What is at an output path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// Nothing yet: created atomically.
    New,
    /// A regular file with this permission mode: replaced atomically, mode kept.
    Regular { mode: u32 },
    /// A FIFO or a character device: written through, never replaced.
    Stream,
}

/// A checked output path (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputTarget {
    /// The path as the user gave it (for messages).
    pub path: PathBuf,
    /// Where the bytes go: `path` with symbolic links resolved.
    pub resolved: PathBuf,
    pub kind: OutputKind,
}

fn err(path: &Path, message: impl Into<String>) -> OutputError {
    OutputError {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// Checks `path` as an output of a command whose inputs are `inputs` (flag, path): the
/// output must not be any of them. Touches nothing.
pub fn check_output(path: &Path, inputs: &[(&str, &Path)]) -> Result<OutputTarget, OutputError> {
    let (resolved, meta) = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (path.to_path_buf(), None),
        Err(e) => return Err(err(path, e.to_string())),
        Ok(m) if m.file_type().is_symlink() => {
            let dangling = |e: std::io::Error| {
                let to = std::fs::read_link(path).map_or("?".into(), |t| t.display().to_string());
                err(
                    path,
                    format!("it is a symbolic link to {to}, which cannot be resolved ({e}); a link is written through, never replaced"),
                )
            };
            let m = std::fs::metadata(path).map_err(dangling)?;
            if m.file_type().is_fifo() || m.file_type().is_char_device() {
                // Opened through the link (`/dev/stdout` names a pipe that has no path).
                (path.to_path_buf(), Some(m))
            } else {
                (std::fs::canonicalize(path).map_err(dangling)?, Some(m))
            }
        }
        Ok(m) => (path.to_path_buf(), Some(m)),
    };
    let Some(meta) = meta else {
        // A new file needs a folder to go in: said now, before the command does its work.
        let dir = match resolved.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(err(path, format!("{} is not a directory", dir.display()))),
            Err(e) => return Err(err(path, format!("its folder {} cannot be used: {e}", dir.display()))),
        }
        return Ok(OutputTarget {
            path: path.to_path_buf(),
            resolved,
            kind: OutputKind::New,
        });
    };
    for (flag, input) in inputs {
        if let Ok(im) = std::fs::metadata(input) {
            if im.dev() == meta.dev() && im.ino() == meta.ino() {
                return Err(err(
                    path,
                    format!(
                        "it is the same file as the input {flag} {}; refusing to overwrite an input",
                        input.display()
                    ),
                ));
            }
        }
    }
    let kind = kind_of(path, &meta)?;
    if let OutputKind::Regular { mode } = kind {
        if mode & 0o222 == 0 {
            return Err(err(
                path,
                format!("it is read-only (mode {:o}); refusing to replace it", mode & 0o7777),
            ));
        }
        // Opening without truncation changes nothing; it fails where the user may not
        // write the file (whatever the directory allows).
        std::fs::OpenOptions::new()
            .write(true)
            .open(&resolved)
            .map_err(|e| err(path, format!("it is not writable ({e}); refusing to replace it")))?;
    }
    Ok(OutputTarget {
        path: path.to_path_buf(),
        resolved,
        kind,
    })
}

fn kind_of(path: &Path, m: &std::fs::Metadata) -> Result<OutputKind, OutputError> {
    let t = m.file_type();
    if t.is_file() {
        Ok(OutputKind::Regular {
            mode: m.permissions().mode(),
        })
    } else if t.is_fifo() || t.is_char_device() {
        Ok(OutputKind::Stream)
    } else {
        let what = if t.is_dir() {
            "a directory"
        } else if t.is_block_device() {
            "a block device"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        Err(err(path, format!("it is {what}; give a file path")))
    }
}

impl OutputTarget {
    /// Writes `bytes` by the rules of the module docs.
    pub fn write(&self, bytes: &[u8]) -> Result<(), OutputError> {
        match self.kind {
            OutputKind::Stream => self.write_through(bytes),
            OutputKind::New | OutputKind::Regular { .. } => self.write_atomic(bytes),
        }
    }

    /// Removes a file this target created (a `New` target whose write succeeded), when a
    /// later output of the same command failed: nothing is left half-done.
    pub fn undo_new(&self) {
        if self.kind == OutputKind::New {
            let _ = std::fs::remove_file(&self.resolved);
        }
    }

    fn write_through(&self, bytes: &[u8]) -> Result<(), OutputError> {
        let e = |m: String| err(&self.path, m);
        // No create, no truncate: a FIFO or a device is opened as it is.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.resolved)
            .map_err(|x| e(x.to_string()))?;
        // The path may have changed since the check: write only to what was checked.
        let m = f.metadata().map_err(|x| e(x.to_string()))?;
        if !matches!(kind_of(&self.path, &m)?, OutputKind::Stream) {
            return Err(e(
                "it changed into a regular file since it was checked; not written".into()
            ));
        }
        f.write_all(bytes).and_then(|_| f.flush()).map_err(|x| e(x.to_string()))
    }

    fn write_atomic(&self, bytes: &[u8]) -> Result<(), OutputError> {
        self.stage(bytes)?.commit()
    }

    /// The first half of a write: for a new path or a regular file, the bytes in a synced
    /// temporary file beside the target (nothing at the path changes yet); for a FIFO or a
    /// device, the bytes kept for the write-through. [`Staged::commit`] does the rest;
    /// dropping a `Staged` leaves the path as it was. Several outputs of one command are
    /// staged first and committed after, so a failure while staging writes none of them.
    pub fn stage(&self, bytes: &[u8]) -> Result<Staged<'_>, OutputError> {
        if self.kind == OutputKind::Stream {
            return Ok(Staged {
                target: self,
                tmp: None,
                bytes: bytes.to_vec(),
            });
        }
        let e = |m: String| err(&self.path, m);
        let dir = match self.resolved.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let tmp = TempFile::create(&dir, &self.resolved)?;
        let mode = match self.kind {
            OutputKind::Regular { mode } => mode & 0o7777,
            _ => 0o644,
        };
        let written = (|| -> std::io::Result<()> {
            let mut f = &tmp.file;
            f.write_all(bytes)?;
            tmp.file.set_permissions(std::fs::Permissions::from_mode(mode))?;
            tmp.file.sync_all()
        })();
        written.map_err(|x| e(x.to_string()))?;
        Ok(Staged {
            target: self,
            tmp: Some(tmp),
            bytes: Vec::new(),
        })
    }
}

/// A staged output ([`OutputTarget::stage`]): committed, or dropped with nothing written.
pub struct Staged<'a> {
    target: &'a OutputTarget,
    tmp: Option<TempFile>,
    /// A stream target's bytes (written at commit).
    bytes: Vec<u8>,
}

impl Staged<'_> {
    /// Puts the staged bytes in place: the temporary file linked or renamed over the path
    /// (after checking the path is still what was checked), or the bytes written through.
    pub fn commit(self) -> Result<(), OutputError> {
        let t = self.target;
        let Some(tmp) = &self.tmp else {
            return t.write_through(&self.bytes);
        };
        let e = |m: String| err(&t.path, m);
        match t.kind {
            // A hard link fails if the name exists: a file (or FIFO, or device) that
            // appeared since the check is never replaced.
            OutputKind::New => match std::fs::hard_link(&tmp.path, &t.resolved) {
                Ok(()) => Ok(()),
                Err(x) if x.kind() == std::io::ErrorKind::AlreadyExists => {
                    Err(e("a file appeared at this path while writing; not replaced".into()))
                }
                // Filesystems without hard links: rename, after checking again.
                Err(_) => match std::fs::symlink_metadata(&t.resolved) {
                    Err(x) if x.kind() == std::io::ErrorKind::NotFound => {
                        std::fs::rename(&tmp.path, &t.resolved).map_err(|x| e(x.to_string()))
                    }
                    _ => Err(e("a file appeared at this path while writing; not replaced".into())),
                },
            },
            _ => {
                let now = std::fs::symlink_metadata(&t.resolved).map_err(|x| e(x.to_string()))?;
                if !now.file_type().is_file() {
                    return Err(e("it is no longer a regular file; not replaced".into()));
                }
                std::fs::rename(&tmp.path, &t.resolved).map_err(|x| e(x.to_string()))
            }
        }
        // `tmp` is dropped with `self`: its name is removed (after a link; a renamed name
        // is gone).
    }
}

/// Writes `bytes` to `path` by the rules of the module docs (no inputs to compare with).
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), OutputError> {
    check_output(path, &[])?.write(bytes)
}

/// A temporary file beside the target, removed when dropped.
struct TempFile {
    path: PathBuf,
    file: std::fs::File,
}

impl TempFile {
    fn create(dir: &Path, target: &Path) -> Result<TempFile, OutputError> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let base = target
            .file_name()
            .map_or("out".into(), |f| f.to_string_lossy().into_owned());
        // The temporary name adds about 30 bytes to the target's: a name near the usual
        // 255-byte limit keeps only its first 200 bytes (the name is ours, never shown).
        let cut = (0..=base.len().min(200))
            .rev()
            .find(|&i| base.is_char_boundary(i))
            .unwrap_or(0);
        let base = &base[..cut];
        let mut last = None;
        for _ in 0..16 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(format!(".{base}.{}.{n}.partial", std::process::id()));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(file) => return Ok(TempFile { path, file }),
                Err(x) if x.kind() == std::io::ErrorKind::AlreadyExists => last = Some(x),
                Err(x) => {
                    return Err(err(
                        target,
                        format!("cannot create a temporary file in {}: {x}", dir.display()),
                    ))
                }
            }
        }
        Err(err(
            target,
            format!(
                "cannot create a temporary file in {}: {}",
                dir.display(),
                last.map_or(String::new(), |x| x.to_string())
            ),
        ))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A staged output changes nothing at its path until committed, and a dropped one leaves
    /// the path as it was with no temporary file behind: what lets a command write two
    /// outputs both or neither (`compile --text`).
    #[test]
    fn staged_outputs_touch_nothing_until_committed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let old = dir.path().join("p.plan.txt");
        std::fs::write(&old, b"old").expect("write");
        let fresh = dir.path().join("p.plan");
        let (t_old, t_new) = (
            check_output(&old, &[]).expect("regular"),
            check_output(&fresh, &[]).expect("new"),
        );
        {
            let a = t_old.stage(b"new text").expect("stage");
            let _b = t_new.stage(b"plan").expect("stage");
            assert_eq!(std::fs::read(&old).expect("read"), b"old");
            assert!(!fresh.exists());
            drop(a);
        }
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["p.plan.txt"], "nothing written, no temporary file left");
        t_new.stage(b"plan").expect("stage").commit().expect("commit");
        t_old.stage(b"new text").expect("stage").commit().expect("commit");
        assert_eq!(std::fs::read(&old).expect("read"), b"new text");
        assert_eq!(std::fs::read(&fresh).expect("read"), b"plan");
    }

    /// A new path in a folder that does not exist (or is a file) is refused by the check,
    /// before any work, naming the folder.
    #[test]
    fn a_new_path_needs_its_folder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("nodir").join("x.plan");
        let e = check_output(&missing, &[]).unwrap_err().to_string();
        assert!(e.contains("nodir") && e.contains("cannot be used"), "{e}");
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").expect("write");
        let e = check_output(&file.join("x.plan"), &[]).unwrap_err().to_string();
        assert!(e.to_lowercase().contains("not a directory"), "{e}");
    }

    /// A name near the 255-byte limit is written: the temporary name beside it is cut short.
    #[test]
    fn a_long_name_is_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let name = "é".repeat(120) + "abcdefghijklmno"; // 255 bytes
        assert_eq!(name.len(), 255);
        let path = dir.path().join(&name);
        write_file(&path, b"plan").expect("a 255-byte name is written");
        assert_eq!(std::fs::read(&path).expect("read"), b"plan");
        let names: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
        assert_eq!(names.len(), 1, "no temporary file left");
    }
}
