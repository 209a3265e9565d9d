//! Where a validation rule was broken: a typed location plus readable text.

use crate::types::PhaseKind;

/// A part of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A plan-wide field, by path (`model.heads`, `capture.page_size`, `layers[2].window`).
    Field(String),
    /// `weights[i]`.
    Weight(u32),
    /// `kernels[i]`.
    Kernel(u32),
    /// A bucket (its phase, index in the phase and batch), optionally one buffer or one
    /// launch (and an argument of it, by field index).
    Bucket {
        phase: PhaseKind,
        index: u32,
        batch: u32,
        buffer: Option<u32>,
        launch: Option<u32>,
        arg: Option<u32>,
    },
}

impl Location {
    pub fn bucket(phase: PhaseKind, index: usize, batch: u32) -> Location {
        Location::Bucket {
            phase,
            index: index as u32,
            batch,
            buffer: None,
            launch: None,
            arg: None,
        }
    }
}

/// One broken rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub at: Location,
    /// The readable form: the path with names, then what is wrong.
    pub message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}
