//! Standard output that a closed pipe ends quietly, and error messages printed once.
//!
//! Rust ignores SIGPIPE, so writing to a pipe whose reader left (`specplan show p.plan |
//! head -1`) fails with `BrokenPipe`; `println!` would panic. Every stdout write goes
//! through [`print`], which turns that failure into [`StdoutClosed`]: the command stops
//! writing and exits as if it had finished (0, or `diff`'s verdict), saying nothing.

use std::io::Write as _;

/// The reader of standard output has gone: not an error of the command.
#[derive(Debug, thiserror::Error)]
#[error("standard output was closed")]
pub struct StdoutClosed;

/// Writes `s` to standard output (flushed, so a closed pipe is seen here, not at exit).
pub fn print(s: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("cannot write to standard output")),
    }
}

/// `writeln!` to standard output through [`print`].
macro_rules! outln {
    () => { $crate::stdout::print("\n")? };
    ($($t:tt)*) => { $crate::stdout::print(&format!("{}\n", format_args!($($t)*)))? };
}

/// `write!` to standard output through [`print`].
macro_rules! out {
    ($($t:tt)*) => { $crate::stdout::print(&format!($($t)*))? };
}

pub(crate) use {out, outln};

/// Whether `e` is a closed standard output (anywhere in its chain).
pub fn is_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<StdoutClosed>().is_some())
}

/// An error and its causes on one line, each message once: a cause whose text its
/// parent already printed (an error that embeds its source) is not repeated.
pub fn message(e: &anyhow::Error) -> String {
    let mut s = String::new();
    for cause in e.chain() {
        let m = cause.to_string();
        if s.is_empty() {
            s = m;
        } else if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Embeds(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("inner detail")]
    struct Inner;

    #[test]
    fn a_cause_is_printed_once() {
        let e = anyhow::Error::new(Embeds(Inner));
        assert_eq!(message(&e), "outer: inner detail");
        let e = anyhow::Error::new(Inner).context("cannot load plan x");
        assert_eq!(message(&e), "cannot load plan x: inner detail");
    }

    #[test]
    fn closed_stdout_is_found_through_context() {
        let e = anyhow::Error::new(StdoutClosed).context("printing");
        assert!(is_closed(&e));
        assert!(!is_closed(&anyhow::anyhow!("other")));
    }
}
