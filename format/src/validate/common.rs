//! Helpers every validation rule uses: the violation collector, the printable-name rule and
//! the kernel facts of an attention instance. (The rule files import these, never each
//! other's parents: `mod.rs` → `phase.rs` → `bucket.rs` → `rules.rs` → `common.rs`.)

use specplan_kernels::facts::KernelFacts;

use crate::location::{Location, Violation};
use crate::types::Plan;

/// Collected violations (at most 64: a corrupted plan would otherwise print thousands).
pub(crate) struct Errors(pub Vec<Violation>);

impl Errors {
    pub fn check(&mut self, ok: bool, at: impl FnOnce() -> (Location, String)) {
        if !ok && self.0.len() < 64 {
            let (at, message) = at();
            self.0.push(Violation { at, message });
        }
    }
    pub fn field(&mut self, ok: bool, path: &str, msg: impl FnOnce() -> String) {
        self.check(ok, || (Location::Field(path.into()), format!("{path}: {}", msg())));
    }
}

/// A name safe to print on one line: non-empty, at most `max` bytes, no control characters.
pub(crate) fn printable(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && !s.chars().any(char::is_control)
}

/// Kernel facts for an attention instance with window `w` (0 = none): `None` when no layer
/// has that window.
pub(crate) fn facts_for_window(p: &Plan, f: &KernelFacts, w: u32) -> Option<KernelFacts> {
    let window = (w != 0).then_some(w);
    p.layers
        .iter()
        .any(|l| l.window == window)
        .then(|| f.with_window(window))
}
